"""torch.distributed side of the collectives sweep: a real multi-process job on localhost.

`TorchJob(world, backend, timeout)` starts `world` Python processes (`subprocess`, env RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT = a free port; gloo on CPU, NCCL on GPU with one
GPU per rank), waits for them to join, and then times one collective per `time(kind, nbytes,
iters, warmup)` call, sent to every rank as a JSON line on stdin; rank 0 answers on stdout. Each
timed call follows a barrier, and a call lasts as long as its slowest rank (MAX all-reduce of the
per-rank times). Every wait is bounded by `timeout`; a dead rank, a silent job or a closed pipe
raises `TorchFailure` with the tail of the ranks' stderr. Imports only the standard library at
module level, so the workers start without jax.
"""
from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "permute")


def torch_op(kind: str, nbytes: int, rank: int, world: int, device):
    import torch
    import torch.distributed as dist
    m = nbytes // 4
    x = torch.ones(m, device=device)
    if kind == "all_reduce":
        x.zero_()  # repeated in-place sums of zeros stay finite
        return lambda: dist.all_reduce(x)
    if kind == "all_gather":
        shard, out = torch.ones(m // world, device=device), torch.empty(m, device=device)
        ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return lambda: ag(out, shard)
    if kind == "reduce_scatter":
        out = torch.empty(m // world, device=device)
        rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return lambda: rs(out, x)
    if kind == "all_to_all":
        out = torch.empty(m, device=device)
        return lambda: dist.all_to_all_single(out, x)
    if kind == "broadcast":
        return lambda: dist.broadcast(x, src=0)
    if kind == "permute":
        out = torch.empty(m, device=device)
        if world == 1:
            return lambda: out.copy_(x)
        ops = lambda: [dist.P2POp(dist.isend, x, (rank + 1) % world),  # noqa: E731
                       dist.P2POp(dist.irecv, out, (rank - 1) % world)]
        return lambda: [w.wait() for w in dist.batch_isend_irecv(ops())]
    raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")


def worker() -> None:
    """One rank of the torch job: env RANK, WORLD_SIZE, MASTER_ADDR/PORT; requests on stdin."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = os.environ.get("JAXSCALE_TORCH_BACKEND", "gloo")
    timeout = float(os.environ.get("JAXSCALE_TORCH_TIMEOUT", "180"))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl backend needs CUDA GPUs, and torch sees none; use gloo")
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.barrier()
    if rank == 0:
        print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "exit":
            break
        op = torch_op(req["kind"], req["nbytes"], rank, world, device)
        times = []
        for _ in range(req["warmup"] + req["iters"]):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            op()
            sync()
            times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times[req["warmup"]:], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a point lasts until its slowest rank
        if rank == 0:
            print("RESULT " + json.dumps(slowest.cpu().tolist()), flush=True)
    dist.destroy_process_group()


class TorchFailure(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchJob:
    """`world` torch worker processes on localhost, started once, driven point by point."""

    def __init__(self, world: int, backend: str, timeout: float):
        self.world, self.backend, self.timeout = world, backend, timeout
        self.logdir = Path(tempfile.mkdtemp(prefix="jaxscale_torch_"))
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1", JAXSCALE_TORCH_BACKEND=backend,
                   JAXSCALE_TORCH_TIMEOUT=str(timeout))
        code = "from jaxscale.comm.torch_bench import worker; worker()"
        self.procs: list[subprocess.Popen] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        for r in range(world):
            log = open(self.logdir / f"rank{r}.log", "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", code], env=dict(env, RANK=str(r)), text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                stderr=log))
            log.close()
        threading.Thread(target=self._read, daemon=True).start()
        self._expect("READY")

    def _read(self) -> None:
        for line in self.procs[0].stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _log_tail(self, chars: int = 1500) -> str:
        tails = []
        for r in range(self.world):
            text = (self.logdir / f"rank{r}.log").read_text(errors="replace").strip()
            if text:
                tails.append(f"[rank {r}] {text[-chars:]}")
        return "\n".join(tails[:2]) or "(no output on stderr)"

    def _expect(self, prefix: str) -> str:
        deadline = time.monotonic() + self.timeout
        while True:
            dead = [r for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            if dead:
                raise TorchFailure(f"torch rank(s) {dead} exited with status "
                                   f"{self.procs[dead[0]].returncode}:\n{self._log_tail()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TorchFailure(f"torch workers gave no {prefix} within {self.timeout:.0f} s:"
                                   f"\n{self._log_tail()}")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:  # rank 0 is gone: give the ranks a moment to report their status
                for p in self.procs:
                    try:
                        p.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                codes = [p.returncode for p in self.procs]
                raise TorchFailure(f"torch rank 0 closed its output; ranks exited with status "
                                   f"{codes} (None = still running):\n{self._log_tail()}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def _send(self, req: dict) -> None:
        msg = json.dumps(req) + "\n"
        for p in self.procs:
            try:
                p.stdin.write(msg)
                p.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                raise TorchFailure(f"torch worker pipe closed ({e}):\n{self._log_tail()}") from e

    def time(self, kind: str, nbytes: int, iters: int, warmup: int) -> list[float]:
        self._send({"kind": kind, "nbytes": nbytes, "iters": iters, "warmup": warmup})
        return json.loads(self._expect("RESULT"))

    def close(self) -> None:
        try:
            self._send({"cmd": "exit"})
        except TorchFailure:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
