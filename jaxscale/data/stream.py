"""Streamed, packed, host-sharded batches from token shards, on Grain.

The pipeline (one per split and process), every stage a Grain dataset:

    MapDataset.source(TokenShards)      document i -> its tokens [BOS] ids [EOS] (two preads)
      .seed(seed).shuffle()             a fresh permutation each epoch (Feistel index shuffle:
      .repeat()                         O(1) memory, random access), epochs back to back
      [p::n]                            process p takes every n-th document of the global order
      .to_iter_dataset()
    FlatMapIterDataset(Chunks(T))       a document of m tokens -> ceil((m-1)/T) examples of at
                                        most T (input, target) pairs; a chunk's positions
                                        restart at 0
    FirstFitPackIterDataset(bins)       first-fit packing into rows of T: adds segment ids
                                        (1, 2, ... per row; 0 = padding) and positions
      .batch(local_batch)

Every document of an epoch goes to exactly one process and is read once; within a process,
memory holds one document and one round of packing bins, whatever the corpus size. A batch row
carries "inputs", "targets", "mask" (1 on real targets), "positions" (per document, for RoPE) and
"segment_ids" (attention stays inside its document); a packed row therefore gives each document
the loss it has alone (tests/test_streaming.py checks it on the tiny model).

Resume: the iterator's state is a small dict (Grain's: the document index the packing round
started at, and the rows of it already emitted). `state()` is the state before the next batch;
`restore(state)` continues from it exactly. `device_batch(i, ...)` also accepts any step i: the
next one continues the stream, an earlier or later one replays from the nearest known state
(exact, but costs reading the batches in between; the state in the checkpoint avoids that).
"""
from __future__ import annotations

import math

import numpy as np

from jaxscale.data.shards import TokenShards, read_manifest

#: at least this many packing bins per round (more bins: less padding, more rows held)
MIN_BINS = 32


class Chunks:
    """A document of m tokens -> examples {"inputs", "targets"} of at most T pairs each
    (chunk c covers tokens [cT, cT + T + 1): consecutive chunks share one token)."""
    max_fan_out = 1 << 20

    def __init__(self, seq_len: int):
        self.T = seq_len

    def flat_map(self, doc: np.ndarray):
        n = len(doc) - 1                      # (input, target) pairs
        return [{"inputs": doc[s:min(s + self.T, n)], "targets": doc[s + 1:min(s + self.T, n) + 1]}
                for s in range(0, n, self.T)]


def packing_bins(local_batch: int) -> int:
    """Bins per packing round: a multiple of the local batch, at least MIN_BINS."""
    return local_batch * max(1, math.ceil(MIN_BINS / local_batch))


def pipeline(source, seq_len: int, local_batch: int, seed: int, process_index: int = 0,
             process_count: int = 1, batch: bool = True, epochs: int | None = None):
    """The Grain IterDataset of packed batches (see the module docstring); `batch=False`: packed
    rows; `epochs`: stop after that many (default: never)."""
    import grain
    import grain.experimental as gx
    ds = grain.MapDataset.source(source).seed(seed).shuffle().repeat(epochs)
    ds = ds[process_index::process_count]
    it = gx.FlatMapIterDataset(ds.to_iter_dataset(), Chunks(seq_len))
    it = gx.FirstFitPackIterDataset(it, length_struct={"inputs": seq_len, "targets": seq_len},
                                    num_packing_bins=packing_bins(local_batch),
                                    shuffle_bins=False)
    return it.batch(local_batch) if batch else it


def _rows(b: dict) -> dict[str, np.ndarray]:
    return {"inputs": b["inputs"].astype(np.int32), "targets": b["targets"].astype(np.int32),
            "mask": (b["targets_segment_ids"] > 0).astype(np.float32),
            "positions": b["inputs_positions"].astype(np.int32),
            "segment_ids": b["inputs_segment_ids"].astype(np.int32)}


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
                             f"{process_count} processes (each packs its own rows)")
        self.manifest = read_manifest(directory)
        self.source = TokenShards(directory, split, self.manifest)
        self.global_batch, self.seq_len, self.seed, self.stream = (global_batch, seq_len, seed,
                                                                    stream)
        self.local_batch = global_batch // process_count
        self.process_index, self.process_count = process_index, process_count
        self._ds = pipeline(self.source, seq_len, self.local_batch,
                            _seed(seed, stream), process_index, process_count)
        self._it, self._next = None, 0
        self._known: dict[int, dict] = {0: None}   # step -> iterator state before it

    def _seek(self, i: int) -> None:
        start = max(s for s in self._known if s <= i) if any(s <= i for s in self._known) else 0
        if not (self._it is not None and start <= self._next <= i):
            self._it = iter(self._ds)
            if self._known.get(start) is not None:
                self._it.set_state(self._known[start])
            self._next = start
        while self._next < i:
            next(self._it)
            self._next += 1

    def local_rows(self, i: int) -> dict[str, np.ndarray]:
        if self._it is None or self._next != i:
            self._seek(i)
        rows = _rows(next(self._it))
        self._next = i + 1
        return rows

    def device_batch(self, i: int, shardings: dict) -> dict:
        """This process's rows of batch i as global arrays; keys without a sharding (a step that
        does not read "positions"/"segment_ids") are left out."""
        import jax
        local = self.local_rows(i)
        return {k: jax.make_array_from_process_local_data(shardings[k], v)
                for k, v in local.items() if k in shardings}

    def state(self) -> dict:
        """JSON-able position: the next batch's index and the iterator state before it."""
        it = self._it if self._it is not None else iter(self._ds)
        return {"step": self._next, "process": self.process_index,
                "processes": self.process_count, "iterator": it.get_state()}

    def restore(self, state: dict) -> None:
        """Continue from `state()` (taken by the same process of a run with as many processes)."""
        if (state.get("processes"), state.get("process")) != (self.process_count,
                                                              self.process_index):
            raise ValueError(f"the data state was saved by process {state.get('process')} of "
                             f"{state.get('processes')}; this is process {self.process_index} of "
                             f"{self.process_count}: resume with as many processes, or let the "
                             f"stream replay from the start")
        self._known[int(state["step"])] = state["iterator"]
        self._it = None
        self._seek(int(state["step"]))


def _seed(seed: int, stream: int) -> int:
    return (int(seed) * 1_000_003 + stream) % 2**31
