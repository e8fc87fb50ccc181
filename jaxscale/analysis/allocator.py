"""A small caching-allocator simulator, for studying fragmentation (topic 20).

It models the allocator PyTorch uses on GPUs (`CUDACachingAllocator`) closely enough to show
where fragmentation comes from; XLA is different: it plans a whole program's temporaries ahead of
time into one buffer (`memory_analysis().temp_size_in_bytes`), and its client allocator (BFC,
`XLA_PYTHON_CLIENT_*`) only sees the program's arguments, outputs and that one temp buffer.

Model:
- every request is rounded up to a multiple of `round_to` bytes (PyTorch: 512);
- requests are served best-fit from cached free blocks of the same pool: `small` for rounded
  sizes <= `small_limit` (1 MiB), `large` above (PyTorch keeps them apart so small tensors do not
  splinter large segments);
- a free block bigger than the request is split; the remainder stays cached if it is at least
  `min_split` bytes, otherwise the whole block is handed out (that slack is internal
  fragmentation);
- with no fitting free block a new segment is reserved from the device ("cudaMalloc"): for the
  small pool one `small_segment` (2 MiB), for the large pool the request rounded up to a multiple
  of `block_size` (PyTorch: 2 MiB, or 20 MiB for requests under 10 MiB);
- freeing returns the block to its pool and merges it with free neighbours of the same segment;
  segments are never returned to the device (`empty_cache()` releases wholly free ones).

`replay(events, ...)` runs a list of ("alloc", id, nbytes) / ("free", id) events and reports the
peak live bytes (requested sizes), the peak reserved bytes, and fragmentation = 1 - live/reserved
at the reserved peak and averaged over the replay. `patterns` builds event lists: uniform random
sizes, per-step tensors whose size follows a growing sequence length, and a transformer-training
step (persistent state; per layer activations kept for the backward, temporaries freed).
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import numpy as np

KiB, MiB = 1 << 10, 1 << 20


@dataclass
class Block:
    segment: int
    offset: int
    size: int
    pool: str
    free: bool = True
    prev: "Block | None" = field(default=None, repr=False)
    next: "Block | None" = field(default=None, repr=False)


class CachingAllocator:
    def __init__(self, block_size: int = 2 * MiB, round_to: int = 512, min_split: int = 512,
                 small_limit: int = 1 * MiB, small_segment: int = 2 * MiB):
        self.block_size, self.round_to, self.min_split = block_size, round_to, min_split
        self.small_limit, self.small_segment = small_limit, small_segment
        self._free: dict[str, list] = {"small": [], "large": []}   # sorted (size, seg, off, blk)
        self._ids = itertools.count()
        self.live: dict[object, tuple[Block, int]] = {}
        self.reserved = self.allocated = self.requested = 0
        self.segments: dict[int, int] = {}
        self.n_device_allocs = 0

    # ------------------------------------------------------------------ internals
    def _round(self, n: int) -> int:
        return max(self.round_to, -(-n // self.round_to) * self.round_to)

    def _insert(self, b: Block) -> None:
        bisect.insort(self._free[b.pool], (b.size, b.segment, b.offset, id(b), b))

    def _remove(self, b: Block) -> None:
        lst = self._free[b.pool]
        i = bisect.bisect_left(lst, (b.size, b.segment, b.offset, id(b)))
        assert lst[i][4] is b
        del lst[i]

    def _new_segment(self, size: int, pool: str) -> Block:
        if pool == "small":
            seg_size = self.small_segment
        else:
            seg_size = -(-size // self.block_size) * self.block_size
        seg = next(self._ids)
        self.segments[seg] = seg_size
        self.reserved += seg_size
        self.n_device_allocs += 1
        return Block(seg, 0, seg_size, pool)

    # ------------------------------------------------------------------ API
    def malloc(self, key, nbytes: int) -> None:
        size = self._round(nbytes)
        pool = "small" if size <= self.small_limit else "large"
        lst = self._free[pool]
        i = bisect.bisect_left(lst, (size,))
        if i < len(lst):
            b = lst[i][4]
            del lst[i]
        else:
            b = self._new_segment(size, pool)
        if b.size - size >= self.min_split:      # split, keep the remainder cached
            rest = Block(b.segment, b.offset + size, b.size - size, pool, True, b, b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, size
            self._insert(rest)
        b.free = False
        self.live[key] = (b, nbytes)
        self.allocated += b.size
        self.requested += nbytes

    def free(self, key) -> None:
        b, nbytes = self.live.pop(key)
        self.allocated -= b.size
        self.requested -= nbytes
        b.free = True
        for nb in (b.prev, b.next):              # merge with free neighbours in the segment
            if nb is not None and nb.free:
                self._remove(nb)
                lo, hi = (nb, b) if nb is b.prev else (b, nb)
                lo.size += hi.size
                lo.next = hi.next
                if hi.next is not None:
                    hi.next.prev = lo
                b = lo
        self._insert(b)

    def empty_cache(self) -> None:
        """Return wholly free segments to the device."""
        for pool, lst in self._free.items():
            keep = []
            for item in lst:
                b = item[4]
                if b.prev is None and b.next is None:
                    self.reserved -= self.segments.pop(b.segment)
                else:
                    keep.append(item)
            self._free[pool] = keep


def replay(events, **allocator_kw) -> dict:
    """Run alloc/free events; peak live and reserved bytes and fragmentation."""
    a = CachingAllocator(**allocator_kw)
    peak_live = peak_res = 0
    live_at_peak = 0
    frag_sum = weight = 0.0
    for ev in events:
        if ev[0] == "alloc":
            a.malloc(ev[1], ev[2])
        else:
            a.free(ev[1])
        peak_live = max(peak_live, a.requested)
        if a.reserved > peak_res or (a.reserved == peak_res and a.requested > live_at_peak):
            peak_res, live_at_peak = a.reserved, a.requested
        if a.reserved:
            frag_sum += 1 - a.requested / a.reserved
            weight += 1
    return {"peak_live": peak_live, "peak_reserved": peak_res,
            "fragmentation_at_peak": 1 - live_at_peak / peak_res if peak_res else 0.0,
            "waste_vs_peak_live": 1 - peak_live / peak_res if peak_res else 0.0,
            "mean_fragmentation": frag_sum / weight if weight else 0.0,
            "device_allocs": a.n_device_allocs, "final_live": a.requested,
            "final_allocated": a.allocated}


# ---------------------------------------------------------------------- allocation patterns
def uniform(n: int = 4000, lo: int = 4 * KiB, hi: int = 8 * MiB, live: int = 64,
            seed: int = 0) -> list:
    """Random sizes, uniform in [lo, hi]; about `live` tensors alive, freed in random order."""
    rng = np.random.default_rng(seed)
    ev, alive = [], []
    for i in range(n):
        ev.append(("alloc", i, int(rng.integers(lo, hi))))
        alive.append(i)
        if len(alive) > live:
            ev.append(("free", alive.pop(int(rng.integers(len(alive))))))
    return ev + [("free", k) for k in alive]


def growing(steps: int = 64, start: int = 128, stop: int = 4096, per_token: int = 4 * KiB,
            tensors: int = 6, seed: int = 0) -> list:
    """Per step, `tensors` activations of seq_len x per_token bytes (varied a little), with the
    sequence length growing from `start` to `stop`; one persistent tensor per step survives
    (a cache that grows with it, like a KV cache)."""
    rng = np.random.default_rng(seed)
    ev, key = [], itertools.count()
    for seq in np.linspace(start, stop, steps).astype(int):
        step = []
        for _ in range(tensors):
            k = next(key)
            ev.append(("alloc", k, int(seq * per_token * rng.uniform(0.5, 1.5))))
            step.append(k)
        ev.append(("alloc", next(key), int(seq * per_token // 16)))     # kept
        ev += [("free", k) for k in step]
    return ev


def transformer(steps: int = 6, layers: int = 8, b: int = 8, h: int = 1024, f: int = 2816,
                heads: int = 16, seqs=(512, 1024, 2048), dtype_bytes: int = 2,
                seed: int = 0) -> list:
    """Training steps of a LLaMA-like model: persistent params + Adam; per layer the forward
    keeps bsh/bsf activations and frees score-sized temporaries, the backward frees them in
    reverse while allocating and freeing gradient temporaries. Sequence length varies per step."""
    rng = np.random.default_rng(seed)
    ev, key = [], itertools.count()
    for _ in range(layers):                       # weights, grads, Adam m and v per layer
        for n in (4 * h * h + 3 * h * f,) * 4:
            ev.append(("alloc", next(key), n * dtype_bytes))
    for _ in range(steps):
        s = int(rng.choice(seqs))
        bsh, bsf, sc = b * s * h * dtype_bytes, b * s * f * dtype_bytes, b * heads * s * s * 4
        kept = []
        for _ in range(layers):
            for n in (bsh, bsh, bsh, bsf, bsf, bsf):
                k = next(key)
                ev.append(("alloc", k, n))
                kept.append(k)
            t = next(key)
            ev += [("alloc", t, sc), ("free", t)]
        for _ in range(layers):
            t = next(key)
            ev += [("alloc", t, sc), ("alloc", t + 10**9, bsf), ("free", t), ("free", t + 10**9)]
            for _ in range(6):
                ev.append(("free", kept.pop()))
    return ev
