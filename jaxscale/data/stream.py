"""Streamed, packed batches from token shards: one global packing, split between processes by rows.

The stream of one split is the same on every process and is decided from document lengths alone:

    order     global index g -> document `grain.MapDataset.range(N).seed(s).shuffle().repeat()[g]`
              (a fresh Feistel permutation each epoch: O(1) memory, random access)
    pieces    a document of m tokens -> ceil((m - 1) / T) pieces of at most T (input, target)
              pairs; consecutive pieces share one token; a piece's positions restart at 0
    rounds    first-fit packing of the pieces into PACK_BINS rows of T; a round closes when a
              piece fits no row (that piece opens the next round); rows leave in bin order
    batches   batch i is the next `global_batch` rows; process p of n keeps rows
              [p B/n, (p+1) B/n) and reads only their tokens (two preads per piece)

Every process reads the lengths (16 bytes of index per document of a round); the tokens of a row
are read only by the process that keeps it. Memory holds one round of piece descriptors and this
process's rows, whatever the corpus size. A row carries "inputs", "targets", "mask" (1 on real
targets), "positions" (per piece, for RoPE) and "segment_ids" (1, 2, ... per piece, 0 padding;
attention stays inside its piece), so a packed row gives each document the loss it has alone.

Data position: `state()` is a small JSON dict: the next batch's index, the round's start (g, piece)
and the rows of that round already emitted. `restore(state)` rebuilds one round from lengths and
continues: O(1) in the step, bitwise the batches of the uninterrupted run. The checkpoint holds it.

Resuming under another process count, data-parallel degree or global batch size: processes split
rows, never documents, and neither the stream nor its position depends on the process count. A
resumed run therefore sees the rows the uninterrupted run would have seen from that position on,
only cut into processes (and batches) differently: every document of an epoch is seen once (each
piece of a long one once), none twice. Another seed, seq_len or shard set is another stream, and
its state is refused with a message saying which.
"""
from __future__ import annotations

import math

import numpy as np

from jaxscale.data.shards import TokenShards, read_manifest

#: rows per packing round (more: less padding, a longer round to rebuild on restore)
PACK_BINS = 64
STATE_VERSION = 2


class Stream:
    """The global rows of one split: each row a list of pieces (document, first token, pairs)."""

    def __init__(self, source: TokenShards, seq_len: int, seed: int, epochs: int | None = None):
        import grain
        self.source, self.T, self.seed = source, seq_len, seed
        self.order = grain.MapDataset.range(len(source)).seed(seed).shuffle().repeat(epochs)
        self.end = len(source) * epochs if epochs else None
        self.lengths_read = 0          # documents whose length was read (resume cost)

    def pieces(self, g: int, c: int):
        """(g, c, document, first token, pairs) from the c-th piece of the g-th document on."""
        while self.end is None or g < self.end:
            d = int(self.order[g])
            n = self.source.length(d) - 1
            self.lengths_read += 1
            for k in range(c, math.ceil(n / self.T)):
                yield g, k, d, k * self.T, min(self.T, n - k * self.T)
            g, c = g + 1, 0

    def round(self, g: int, c: int) -> tuple[list[list[tuple]], tuple[int, int] | None]:
        """The rows of the round starting at piece (g, c), and where the next round starts
        (None: the stream ended)."""
        room = np.full(PACK_BINS, self.T)
        rows: list[list[tuple]] = [[] for _ in range(PACK_BINS)]
        for g2, k, d, lo, n in self.pieces(g, c):
            fits = np.flatnonzero(room >= n)
            if not len(fits):
                return rows, (g2, k)
            rows[fits[0]].append((d, lo, n))
            room[fits[0]] -= n
        return [r for r in rows if r], None

    def rows(self, start: tuple[int, int] = (0, 0), emitted: int = 0):
        """(row, position after it) from a position (round start, rows of it emitted)."""
        at = tuple(start)
        while at is not None:
            rows, nxt = self.round(*at)
            for k in range(emitted, len(rows)):
                yield rows[k], (at, k + 1)
            at, emitted = nxt, 0

    def read(self, row: list[tuple]) -> dict[str, np.ndarray]:
        """One row's arrays: this is where its tokens are read."""
        T = self.T
        out = {k: np.zeros(T, np.int32) for k in ("inputs", "targets", "positions",
                                                   "segment_ids")}
        at = 0
        for s, (d, lo, n) in enumerate(row, 1):
            tok = self.source.read(d, lo, lo + n + 1)
            out["inputs"][at:at + n], out["targets"][at:at + n] = tok[:-1], tok[1:]
            out["positions"][at:at + n], out["segment_ids"][at:at + n] = np.arange(n), s
            at += n
        out["mask"] = (out["segment_ids"] > 0).astype(np.float32)
        return out


class PackedBatches:
    """Packed batches of one split of a shards directory, this process's rows only.

    Same interface as `jaxscale.data.Batches` (`local_rows(i)`, `device_batch(i, shardings)`),
    plus `state()` / `restore(state)` for checkpoints. `stream` 0 is training, 1 held-out (a
    different seed, as in `Batches`); `process_index`/`process_count` default to JAX's."""

    def __init__(self, directory, split: str, global_batch: int, seq_len: int, seed: int,
                 stream: int = 0, process_index: int | None = None,
                 process_count: int | None = None):
        if process_index is None or process_count is None:
            import jax
            process_index, process_count = jax.process_index(), jax.process_count()
        if global_batch % process_count:
            raise ValueError(f"data.batch_size={global_batch} must be divisible by the "
                             f"{process_count} processes (each keeps its share of the rows)")
        self.manifest = read_manifest(directory)
        self.directory, self.split = str(directory), split
        self.source = TokenShards(directory, split, self.manifest)
        self.global_batch, self.seq_len, self.seed = global_batch, seq_len, _seed(seed, stream)
        self.local_batch = global_batch // process_count
        self.process_index, self.process_count = process_index, process_count
        self.stream = Stream(self.source, seq_len, self.seed)
        self._it, self._next, self._pos = None, 0, ((0, 0), 0)
        self._known: dict[int, tuple] = {0: ((0, 0), 0)}   # step -> position before it

    def _seek(self, i: int) -> None:
        start = max(s for s in self._known if s <= i)
        if not (self._it is not None and start <= self._next <= i):
            self._pos = self._known[start]
            self._it = self.stream.rows(*self._pos)
            self._next = start
        while self._next < i:
            self._take()

    def _take(self) -> list[list[tuple]]:
        """The next global batch's rows (piece lists), advancing the position."""
        rows = []
        for _ in range(self.global_batch):
            row, self._pos = next(self._it)
            rows.append(row)
        self._next += 1
        self._known = {s: p for s, p in self._known.items() if s == 0 or s > self._next - 8}
        self._known[self._next] = self._pos
        return rows

    def global_pieces(self, i: int) -> list[list[tuple]]:
        """Batch i as the pieces of every row of every process (lengths only, no tokens)."""
        if self._it is None or self._next != i:
            self._seek(i)
        return self._take()

    def local_rows(self, i: int) -> dict[str, np.ndarray]:
        rows = self.global_pieces(i)
        p, n = self.process_index, self.local_batch
        mine = [self.stream.read(r) for r in rows[p * n:(p + 1) * n]]
        return {k: np.stack([r[k] for r in mine]) for k in mine[0]}

    def device_batch(self, i: int, shardings: dict) -> dict:
        """This process's rows of batch i as global arrays; keys without a sharding (a step that
        does not read "positions"/"segment_ids") are left out."""
        import jax
        local = self.local_rows(i)
        return {k: jax.make_array_from_process_local_data(shardings[k], v)
                for k, v in local.items() if k in shardings}

    def _identity(self) -> dict:
        return {"split": self.split, "seq_len": self.seq_len, "seed": self.seed,
                "docs": len(self.source),
                "tokenizer": self.manifest["tokenizer"].get("sha256", "")}

    def state(self) -> dict:
        """JSON-able position before the next batch (the same on every process)."""
        (g, c), emitted = self._pos
        return {"version": STATE_VERSION, "step": self._next, "round": [int(g), int(c)],
                "emitted": int(emitted), **self._identity()}

    def restore(self, state: dict) -> None:
        """Continue from `state()`, taken by any process of a run with any process count."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"the data state {str(state)[:80]!r} is not a version-"
                             f"{STATE_VERSION} stream position: resume without it (the stream "
                             f"replays from the start to the checkpoint's step)")
        mine = self._identity()
        differ = [f"{k} {state.get(k)!r} there, {v!r} here" for k, v in mine.items()
                  if state.get(k) != v]
        if differ:
            raise ValueError(f"the data state was saved for another stream of "
                             f"data.shards={self.directory!r} ({'; '.join(differ)}): resume "
                             f"with the data settings of the checkpointed run")
        step = int(state["step"])
        self._known = {0: ((0, 0), 0), step: (tuple(state["round"]), int(state["emitted"]))}
        self._it = None
        self._seek(step)


def _seed(seed: int, stream: int) -> int:
    return (int(seed) * 1_000_003 + stream) % 2**31
