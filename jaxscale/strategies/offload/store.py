"""The NVMe tier's working store: each offloaded leaf of the train state in a file of its own
under `plan.offload_dir`, read and written one piece (a layer of every stacked leaf, or one
unstacked leaf) at a time through `np.memmap` windows over just that piece, with one piece of
read-ahead on a background thread. No collective; the cost is disk bandwidth, counted here
(`bytes_read`, `bytes_written`) and predicted by `offload/tiers.py`.

A window is unmapped as soon as it is copied (read) or flushed (written), so the process maps
(and counts in its RSS) at most the pieces in flight: the one being updated, the next one being
read, the previous one being written. The files are a working store, not a checkpoint: a run's
checkpoint is the Orbax checkpoint of the whole train state (`full_state` in `offload/driver.py`)
and a resume writes the restored state back into fresh files.

A store's directory is named `jaxscale-offload-<host>-<pid>-<random>`: a process killed before it
could remove its own (`kill -9`) leaves it behind, and the next store opened under the same
directory removes it (`sweep`) once no process of that id runs on this host, saying so on stderr.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Leaf:
    shape: tuple
    dtype: np.dtype
    stacked: bool             # leading `layers` dimension: read and written a layer at a time

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def window(self, layer):
        """(byte offset, shape) of the piece: layer `layer`, or the whole leaf when None."""
        if layer is None:
            return 0, self.shape
        rest = self.shape[1:]
        return layer * int(np.prod(rest, dtype=np.int64)) * np.dtype(self.dtype).itemsize, rest


class Store:
    """Files for `leaves` in a fresh directory under `root` (removed with the store)."""

    def __init__(self, root: str, leaves: list[Leaf]):
        sweep(root)
        self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{_host()}-{os.getpid()}-", dir=root)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.leaves = leaves
        self.bytes_read = 0
        self.bytes_written = 0
        for k, leaf in enumerate(leaves):
            with open(self._path(k), "wb") as f:
                f.truncate(leaf.nbytes)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="offload-io")

    def _path(self, k: int) -> str:
        return os.path.join(self.dir, f"{k:04d}.bin")

    def read(self, k: int, layer=None) -> np.ndarray:
        leaf = self.leaves[k]
        offset, shape = leaf.window(layer)
        if not shape or 0 in shape:
            m = np.fromfile(self._path(k), leaf.dtype, int(np.prod(shape)), offset=offset)
            out = m.reshape(shape)
        else:
            m = np.memmap(self._path(k), leaf.dtype, "r", offset, shape)
            out = np.array(m)
            del m                                   # unmapped: only the copy stays
        self.bytes_read += out.nbytes
        return out

    def write(self, k: int, value, layer=None) -> None:
        leaf = self.leaves[k]
        offset, shape = leaf.window(layer)
        value = np.asarray(value, leaf.dtype).reshape(shape)
        if not shape or 0 in shape:
            with open(self._path(k), "r+b") as f:
                f.seek(offset)
                f.write(value.tobytes())
        else:
            m = np.memmap(self._path(k), leaf.dtype, "r+", offset, shape)
            m[...] = value
            m.flush()
            del m
        self.bytes_written += value.nbytes

    # ------------------------------------------------------------------ streaming
    def stream(self, pieces, keys, update):
        """For each piece (a layer number, or ("leaf", j)), `update(piece, {k: old})` -> {k: new}
        over the store leaves `keys(piece)`; the next piece is read on the I/O thread while this
        one updates, and the new values are written behind it, in order."""
        pieces = list(pieces)

        def load(p):
            return {k: self.read(k, layer) for k, layer in keys(p)}
        ahead = self._io.submit(load, pieces[0]) if pieces else None
        writes = []
        for n, p in enumerate(pieces):
            old = ahead.result()
            ahead = self._io.submit(load, pieces[n + 1]) if n + 1 < len(pieces) else None
            new = update(p, old)
            del old
            slots = dict(keys(p))
            writes.append(self._io.submit(
                lambda new=new, slots=slots: [self.write(k, v, slots[k]) for k, v in new.items()]))
            if len(writes) > 1:                     # at most one piece waits to be written
                writes.pop(0).result()
        for w in writes:
            w.result()

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._cleanup()


class RamStore(Store):
    """The same store in host RAM (the host tier with the host update)."""

    def __init__(self, leaves):                     # noqa: D107 - no files, no I/O thread
        self.leaves, self.bytes_read, self.bytes_written = leaves, 0, 0
        self.arrays = [np.zeros(leaf.shape, leaf.dtype) for leaf in leaves]
        self._io = ThreadPoolExecutor(1)

    def read(self, k, layer=None):
        return self.arrays[k] if layer is None else self.arrays[k][layer]

    def write(self, k, value, layer=None):
        if layer is None:
            self.arrays[k] = np.asarray(value, self.leaves[k].dtype)
        else:
            self.arrays[k][layer] = value

    def close(self):
        self._io.shutdown(wait=True)


PREFIX = "jaxscale-offload-"


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_") or "localhost"


def _alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host (signal 0: no such process, or not ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(root: str) -> list[str]:
    """Remove the store directories under `root` left by processes of this host that are gone;
    those of live processes and of other hosts stay. The removed paths."""
    gone = []
    for name in sorted(os.listdir(root)):
        parts = name[len(PREFIX):].rsplit("-", 2) if name.startswith(PREFIX) else []
        if len(parts) != 3 or parts[0] != _host() or not parts[1].isdigit():
            continue
        pid, path = int(parts[1]), os.path.join(root, name)
        if pid == os.getpid() or _alive(pid) or not os.path.isdir(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
        print(f"jaxscale offload: removed {path}, the offload store of process {pid}, which is "
              f"no longer running (killed before it could remove it)", file=sys.stderr,
              flush=True)
    return gone


def probe(directory: str, need: float, key: str = "plan.offload_dir") -> str | None:
    """Why `directory` cannot hold the store (`need` bytes), or None: it must exist, take a file
    (tried: permission bits say little to root or on read-only mounts) and have the space."""
    if not directory:
        return (f"{key} is empty: plan.offload_tier=nvme keeps the offloaded state in files; set "
                f"{key}=/path/on/nvme (an existing, writable directory)")
    if os.path.exists(directory) and not os.path.isdir(directory):
        return (f"{key}={directory!r} is a file, not a directory: point {key} at a directory "
                f"on the NVMe drive (or move the file away and create the directory there)")
    parent = os.path.dirname(os.path.abspath(directory))
    while not os.path.exists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(directory) and not os.path.isdir(parent):
        return (f"{key}={directory!r} cannot be created: {parent!r} is a file, not a "
                f"directory; point {key} at a directory on the NVMe drive")
    if not os.path.isdir(directory):
        return (f"{key}={directory!r} does not exist: create it (mkdir -p {directory}) or point "
                f"{key} at a directory on the NVMe drive")
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".jaxscale-probe-") as f:
            f.write(b"\0")
            f.flush()
    except OSError as e:
        return (f"{key}={directory!r} is not writable ({e.strerror}): choose a directory this "
                f"user can write, or fix its permissions / remount it read-write")
    free = shutil.disk_usage(directory).free
    if free < need:
        return (f"{key}={directory!r} has {free / 2**30:.2f} GiB free but the offloaded state "
                f"needs {need / 2**30:.2f} GiB ({need:,.0f} bytes): free space, choose another "
                f"directory, or offload less (plan.offload) / use plan.offload_tier=host")
    return None
