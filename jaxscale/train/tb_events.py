"""TensorBoard event files of scalars, written directly: a TFRecord stream (each record its
length, the length's masked CRC-32C, the bytes, their masked CRC-32C) of `Event` protocol buffers
encoded here. A writer that pulls in a deep-learning framework to write a float per step costs each
training process seconds of imports; these are the five fields a scalar needs.

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
              Summary summary = 5; SessionLog session_log = 7; }
    Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
    SessionLog { Status status = 1; }       START = 1 (with `step`: purge later steps on resume)
"""
from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord frames use."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1                  # int64 fields: a negative number is ten bytes
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(step: int, *, scalars: dict[str, float] | None = None, file_version: str | None = None,
          session_start: bool = False, wall_time: float | None = None) -> bytes:
    """One serialized `Event`."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", time.time() if wall_time is None else wall_time)
    out += _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        out += _field(5, b"".join(_field(1, _field(1, tag.encode()) + _varint(2 << 3 | 5)
                                         + struct.pack("<f", value))
                                  for tag, value in scalars.items()))
    if session_start:
        out += _field(7, _varint(1 << 3) + _varint(1))
    return out


def record(data: bytes) -> bytes:
    """`data` framed as one TFRecord."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I",
                                                                               masked_crc(data))


_opened = itertools.count()


class EventWriter:
    """An event file in `logdir` (made if missing), `events.out.tfevents.<time>.<host>.<pid>.<n>`,
    opened with the version record; `purge_step=s` tells TensorBoard to hide the events of earlier
    files at steps >= s (a resumed run rewrites them)."""

    def __init__(self, logdir: Path, purge_step: int | None = None):
        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = logdir / (f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
                              f".{os.getpid()}.{next(_opened)}")
        self._file = open(self.path, "wb")
        self._file.write(record(event(purge_step or 0, file_version="brain.Event:2",
                                      wall_time=now)))
        if purge_step is not None:
            self._file.write(record(event(purge_step, session_start=True, wall_time=now)))
        self._file.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._file.write(record(event(step, scalars=values)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
