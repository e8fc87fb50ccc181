"""The parameter server's messages over ZeroMQ: a JSON header frame, then one frame per array.

A worker holds a REQ socket (`Client`: one request, one reply, in turn); the server one ROUTER
socket (`serve_once` reads a request with the worker's identity and answers it). ZeroMQ frames
the messages, queues them and reconnects; arrays travel as their raw bytes (zero copies on
send), described in the header by dtype and shape. Requests:

    hello  {worker}                     -> {step, position, done}
    pull   {worker}                     -> {step, done} + the parameters (fp32, tree order)
    push   {worker, pulled, position, loss, tokens, seconds} + gradients or a parameter change
                                         -> {step, applied, staleness, done}
"""
from __future__ import annotations

import json

import numpy as np

#: a worker gives up on a silent server after this long (the supervisor restarts the run)
TIMEOUT_MS = 300_000


def encode(header: dict, arrays=()) -> list:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    head = dict(header, arrays=[[a.dtype.str, list(a.shape)] for a in arrays])
    return [json.dumps(head).encode()] + [memoryview(a).cast("B") for a in arrays]


def decode(frames: list) -> tuple[dict, list[np.ndarray]]:
    head = json.loads(bytes(frames[0]))
    arrays = [np.frombuffer(bytes(f), dtype=np.dtype(d)).reshape(shape)
              for f, (d, shape) in zip(frames[1:], head.pop("arrays", []))]
    return head, arrays


class Client:
    """A worker's connection to the server at `address` (tcp://host:port)."""

    def __init__(self, address: str, timeout_ms: int = TIMEOUT_MS):
        import zmq
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.address = address

    def request(self, header: dict, arrays=()) -> tuple[dict, list[np.ndarray]]:
        import zmq
        self.sock.send_multipart(encode(header, arrays), copy=False)
        try:
            return decode(self.sock.recv_multipart())
        except zmq.Again:
            raise TimeoutError(f"the parameter server at {self.address} did not answer a "
                               f"{header.get('op')!r} within {TIMEOUT_MS / 1000:.0f} s") from None

    def close(self) -> None:
        self.sock.close(linger=0)


def bind(address: str):
    """The server's ROUTER socket on `address`; a clear error when the port is taken."""
    import zmq
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close()
        raise ValueError(f"the parameter server cannot listen on {address}: {e} (choose another "
                         f"--port, or 0 for a free one)") from None
    return sock


def receive(sock, timeout_ms: int) -> tuple[bytes, dict, list] | None:
    """The next request (worker identity, header, arrays), or None after `timeout_ms`."""
    if not sock.poll(timeout_ms):
        return None
    identity, _, *frames = sock.recv_multipart(copy=False)
    head, arrays = decode(frames)
    return identity.bytes, head, arrays


def reply(sock, identity: bytes, header: dict, arrays=()) -> None:
    sock.send_multipart([identity, b""] + encode(header, arrays), copy=False)
