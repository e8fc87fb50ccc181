"""Which tiles an attention kernel visits: block-sparse masks, the static tile map, tile masks.

Attention kernels cut queries into blocks of `block_q` rows and keys/values into blocks of
`block_k`, and visit only the (query block, key block) tiles that the mask lets through: causal,
sliding-window (d = t + q_offset - s in [0, window)) and block-sparse masks (`BlockSparseMask`,
static, at block granularity) skip whole tiles. `tile_map` lists the visited tiles per query block
and per key block (`TileMap`), full tiles (wholly allowed: no element mask needed) before partial
ones; it is computed once per static configuration, in numpy, and shared by the blockwise loops
(`blockwise.py`), the Pallas kernels (`flash_forward.py`, `flash_backward.py`) and the ring's
work count (`strategies/sp/seq_layout.py`). `tile_mask` is the element mask of one tile.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class BlockSparseMask:
    """A static mask at block granularity: query block a may see key block b iff blocks[a][b].

    Element (t, s) is allowed iff blocks[t // block_q][s // block_k]. Kernel tiles must divide these
    blocks so that every tile is wholly in or wholly out (the kernels then skip the 'out' tiles).
    """
    blocks: tuple[tuple[bool, ...], ...]
    block_q: int
    block_k: int

    @classmethod
    def from_array(cls, blocks, block_q: int, block_k: int) -> "BlockSparseMask":
        arr = np.asarray(blocks, dtype=bool)
        if arr.ndim != 2:
            raise ValueError(f"block mask must be 2-D [query blocks, key blocks], got {arr.shape}")
        return cls(tuple(tuple(bool(x) for x in row) for row in arr), int(block_q), int(block_k))

    @classmethod
    def local(cls, n_q: int, n_k: int, width: int, block_q: int, block_k: int,
              causal: bool = True, global_blocks: int = 0) -> "BlockSparseMask":
        """Banded layout: query block a sees key blocks a-width+1..a (and a+width-1 if not causal),
        plus the first `global_blocks` key blocks (attention sinks / global tokens)."""
        a, b = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
        m = (b > a - width) & ((b <= a) if causal else (b < a + width))
        m |= b < global_blocks
        return cls.from_array(m, block_q, block_k)

    def array(self) -> np.ndarray:
        return np.asarray(self.blocks, dtype=bool)

    def dense(self, T: int, S: int) -> np.ndarray:
        """Element mask [T, S] (for the reference implementation)."""
        arr = self.array()
        nq, nk = -(-T // self.block_q), -(-S // self.block_k)
        if arr.shape[0] < nq or arr.shape[1] < nk:
            raise ValueError(f"block mask {arr.shape} too small for T={T}, S={S} with blocks "
                             f"({self.block_q}, {self.block_k}): need at least ({nq}, {nk})")
        return arr[np.arange(T) // self.block_q][:, np.arange(S) // self.block_k]

    def density(self, T: int, S: int) -> float:
        return float(self.dense(T, S).mean())


@dataclass(frozen=True, eq=False)
class TileMap:
    """Which (query block, key block) tiles a kernel visits, full tiles listed before partial ones.

    kv_index[i, :kv_count[i]] are the key blocks of query block i; the first kv_full[i] of them are
    entirely allowed (no element mask needed). q_index / q_count / q_full are the transpose (query
    blocks per key block) for the dK/dV pass.
    """
    block_q: int
    block_k: int
    kv_index: np.ndarray
    kv_count: np.ndarray
    kv_full: np.ndarray
    q_index: np.ndarray
    q_count: np.ndarray
    q_full: np.ndarray
    visited: int          # tiles visited
    full: int             # of which need no element mask
    dense: int            # tiles of the dense [T, S] problem

    @property
    def num_q_blocks(self) -> int:
        return len(self.kv_count)

    @property
    def num_k_blocks(self) -> int:
        return len(self.q_count)


def _index_lists(any_RC: np.ndarray, full_RC: np.ndarray):
    """Per row: column indices, full ones first. -> (index [R, max(1, C_max)], count, full)."""
    count, nfull = any_RC.sum(1), full_RC.sum(1)
    index = np.zeros((any_RC.shape[0], max(1, int(count.max(initial=0)))), np.int32)
    for r in range(any_RC.shape[0]):
        cols = np.concatenate([np.flatnonzero(full_RC[r]), np.flatnonzero(any_RC[r] & ~full_RC[r])])
        index[r, :len(cols)] = cols
        if 0 < len(cols) < index.shape[1]:
            index[r, len(cols):] = cols[-1]
    return index, count.astype(np.int32), nfull.astype(np.int32)


@functools.lru_cache(maxsize=512)
def tile_map(T: int, S: int, block_q: int, block_k: int, *, causal: bool,
             window: int | None = None, q_offset: int = 0,
             block_mask: BlockSparseMask | None = None) -> TileMap:
    """Static list of tiles that hold at least one allowed (query, key) pair.

    With d = t + q_offset - s, causal keeps d >= 0 and a window keeps d < window; over a tile d
    spans every integer in [t0 + q_offset - s1, t1 + q_offset - s0], so a tile is visited iff that
    interval meets the allowed one, and is full iff it lies inside it and holds no padded query or
    key (padded rows are always masked, so forward and backward agree on them whatever their block
    sizes).
    """
    nq, nk = -(-T // block_q), -(-S // block_k)
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    t0, t1 = i * block_q, np.minimum((i + 1) * block_q, T) - 1
    s0, s1 = j * block_k, np.minimum((j + 1) * block_k, S) - 1
    dmin, dmax = t0 + q_offset - s1, t1 + q_offset - s0
    lo = 0 if causal else -np.inf
    hi = window - 1 if window is not None else np.inf
    any_ = (dmax >= lo) & (dmin <= hi)
    full = (dmin >= lo) & (dmax <= hi) & ((i + 1) * block_q <= T) & ((j + 1) * block_k <= S)
    if block_mask is not None:
        bm = block_mask
        if bm.block_q % block_q or bm.block_k % block_k:
            raise ValueError(f"kernel tiles ({block_q}, {block_k}) must divide the block-sparse "
                             f"mask's blocks ({bm.block_q}, {bm.block_k}); "
                             f"pass smaller block sizes")
        arr = bm.array()
        if arr.shape[0] < -(-T // bm.block_q) or arr.shape[1] < -(-S // bm.block_k):
            raise ValueError(f"block mask {arr.shape} too small for T={T}, S={S} with blocks "
                             f"({bm.block_q}, {bm.block_k})")
        tile_ok = arr[(i * block_q) // bm.block_q, (j * block_k) // bm.block_k]
        any_, full = any_ & tile_ok, full & tile_ok
    full = full & any_
    kv_index, kv_count, kv_full = _index_lists(any_, full)
    q_index, q_count, q_full = _index_lists(any_.T, full.T)
    return TileMap(block_q, block_k, kv_index, kv_count, kv_full, q_index, q_count, q_full,
                   int(any_.sum()), int(full.sum()), nq * nk)


def tile_mask(q_pos, kv_pos, *, causal: bool, window: int | None = None, kv_len: int | None = None,
              q_len: int | None = None, q_segment_ids=None, kv_segment_ids=None):
    """Boolean mask [B or 1, Tq, Sk] for a tile given absolute positions q_pos [Tq], kv_pos [Sk].

    Keys at kv_pos >= kv_len and queries at q_pos >= q_len (padding) are masked; segment ids
    ([B, Tq], [B, Sk]) keep equal ids.
    """
    d = q_pos[:, None] - kv_pos[None, :]
    mask = jnp.ones(d.shape, bool)
    if causal:
        mask &= d >= 0
    if window is not None:
        mask &= d < window
    if kv_len is not None:
        mask &= (kv_pos < kv_len)[None, :]
    if q_len is not None:
        mask &= (q_pos < q_len)[:, None]
    mask = mask[None]
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    return mask
