"""Pallas FlashAttention: the forward kernel and the pieces all three kernels share.

Forward: one program per (query block, batch, query head) keeps its q tile, the running row max m,
row sum l and an fp32 accumulator on chip and loops over the key/value tiles the mask allows (the
static `TileMap` of `tiles.py`: causal, sliding-window and block-sparse masks skip whole tiles;
tiles wholly inside the mask skip the element mask too). It writes O and the log-sum-exp per
row, never the [T, S] scores: HBM traffic and memory are O(T·D) per head instead of O(T·S).

Loops: without a block-sparse mask the tiles of a row are one contiguous run of blocks whose full
tiles are a contiguous sub-run, so a program reads four numbers (first, first full, end of full,
end) and its loops address K/V (or Q/dO) affinely in the loop counter, which Triton can software-
pipeline; block-sparse masks walk index lists instead. Query-block programs are launched in reverse
block order, so under a causal mask the longest rows start first.

Shared with the backward kernels (`flash_backward.py`): the static config `_Cfg` (true lengths,
mask, tuning; `plan` gives a kernel its tile, its tile map and the loop tables its programs
read), the loop tables (`_row_tables`, `_trips`), the row loop, the element mask of a tile and
the fp32-accumulating matmul. The public call, its custom VJP and the tuning are in
`flash_attention.py`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxscale.kernels.blockwise import MASK_VALUE
from jaxscale.kernels.flash_tuning import KernelConfig, Tuning
from jaxscale.kernels.tiles import BlockSparseMask, TileMap, tile_map

try:  # the Triton backend of Pallas (deprecated upstream from jax 0.11, still present)
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

LOG2E = math.log2(math.e)
F32 = jnp.float32


# ----------------------------------------------------------------------------- shared pieces
@dataclass(frozen=True)
class _Cfg:
    T: int
    S: int
    causal: bool
    window: int | None
    q_offset: int
    scale: float
    block_mask: BlockSparseMask | None
    tuning: Tuning
    has_seg: bool
    interpret: bool
    precision: lax.Precision | None

    def plan(self, kernel: str) -> tuple[KernelConfig, TileMap, list[np.ndarray]]:
        """The kernel's tile, its tile map and the loop tables its programs read."""
        kc = getattr(self.tuning, kernel)
        sch = tile_map(self.T, self.S, kc.block_q, kc.block_k, causal=self.causal,
                       window=self.window, q_offset=self.q_offset, block_mask=self.block_mask)
        return kc, sch, _row_tables(sch, kernel == "dkdv", contiguous=self.block_mask is None)

    def params(self, kernel: str):
        if self.interpret or pltriton is None:
            return None
        kc = getattr(self.tuning, kernel)
        return pltriton.CompilerParams(num_warps=kc.num_warps, num_stages=kc.num_stages)


def _row_tables(sch: TileMap, transpose: bool, contiguous: bool) -> list[np.ndarray]:
    """Per program row (query block; key block if transpose): contiguous -> one [4, R] table of
    (first, first full, end of full, end) block; else index lists [R, C], count and full [1, R]."""
    index, count, full = ((sch.q_index, sch.q_count, sch.q_full) if transpose else
                          (sch.kv_index, sch.kv_count, sch.kv_full))
    if not contiguous:
        return [index, count[None], full[None]]
    rng = np.zeros((4, len(count)), np.int32)
    for r, (n, nf) in enumerate(zip(count, full)):
        if n:
            cols = index[r, :n]
            a, b = cols.min(), cols.max() + 1
            f0, f1 = (cols[:nf].min(), cols[:nf].max() + 1) if nf else (a, a)
            if b - a != n or f1 - f0 != nf:
                raise AssertionError(f"row {r} of the tile map is not contiguous: {cols}")
            rng[:, r] = a, f0, f1, b
    return [rng]


def _trips(tables: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(tiles, full tiles) each row's loops visit, from the same bounds `_row_loop` uses."""
    if len(tables) == 1:
        a, f0, f1, b = tables[0]
        return (f1 - f0) + (f0 - a) + (b - f1), f1 - f0
    return tables[1][0], tables[2][0]


def _row_loop(tabs, r, visit, carry, masked_full: bool):
    """Visit the tiles listed for row r: full tiles first (element mask only if segment ids), then
    the partial ones with the element mask. visit(block, carry, masked) -> carry."""
    if len(tabs) == 1:    # contiguous: [a, f0) partial, [f0, f1) full, [f1, b) partial
        rng = tabs[0]
        a, f0, f1, b = rng[0, r], rng[1, r], rng[2, r], rng[3, r]
        carry = lax.fori_loop(f0, f1, lambda j, c: visit(j, c, masked_full), carry)
        left = f0 - a
        return lax.fori_loop(0, left + b - f1, lambda n, c: visit(
            jnp.where(n < left, a + n, f1 - left + n), c, True), carry)
    index_ref, count_ref, full_ref = tabs
    n_full, n_all = full_ref[0, r], count_ref[0, r]
    carry = lax.fori_loop(0, n_full, lambda n, c: visit(index_ref[r, n], c, masked_full), carry)
    return lax.fori_loop(n_full, n_all, lambda n, c: visit(index_ref[r, n], c, True), carry)


def _dot(a, b, cfg, contract=(1, 1)):
    """2-D matmul with fp32 accumulation; contract=(1,1) is a @ b.T, (1,0) a @ b, (0,0) a.T @ b."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=cfg.precision, preferred_element_type=F32)


def _tile_mask(cfg: _Cfg, q_pos, kv_pos, qseg, kseg, kv_major: bool = False):
    """[bq, bk] bool ([bk, bq] if kv_major) for padded query rows q_pos and key rows kv_pos."""
    col, row = (slice(None), None), (None, slice(None))     # x[:, None] / x[None, :]
    qx, kx = (row, col) if kv_major else (col, row)
    q_pos, kv_pos = q_pos[qx], kv_pos[kx]
    mask = (kv_pos < cfg.S) & (q_pos < cfg.T)
    d = q_pos + cfg.q_offset - kv_pos
    if cfg.causal:
        mask = mask & (d >= 0)
    if cfg.window is not None:
        mask = mask & (d < cfg.window)
    if qseg is not None:
        mask = mask & (qseg[qx] == kseg[kx])
    return mask


def _full_spec(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


# ----------------------------------------------------------------------------- forward
def _fwd_kernel(*refs, cfg: _Cfg, bq: int, bk: int, nq: int, n_tab: int):
    tabs, (q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref) = refs[:n_tab], refs[n_tab:]
    i = nq - 1 - pl.program_id(0)                           # longest rows first
    q = q_ref[...]                                          # [bq, Dp]
    q_pos = i * bq + jnp.arange(bq)
    qseg = None if qseg_ref is None else qseg_ref[...]
    qk_scale = cfg.scale * LOG2E                            # exp2 domain

    def visit(j, carry, masked):
        m, row_sum, acc = carry
        rows = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k, v = k_ref[rows, :], v_ref[rows, :]               # [bk, Dp]
        s = _dot(q, k, cfg) * qk_scale                      # [bq, bk] fp32
        if masked:
            kseg = None if kseg_ref is None else kseg_ref[rows]
            mask = _tile_mask(cfg, q_pos, j * bk + jnp.arange(bk), qseg, kseg)
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp2(m - m_new)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, cfg, (1, 0))
        return m_new, alpha * row_sum + jnp.sum(p, axis=1), acc

    init = (jnp.full((bq,), MASK_VALUE, F32), jnp.zeros((bq,), F32),
            jnp.zeros((bq, q.shape[-1]), F32))
    m, row_sum, acc = _row_loop(tabs, i, visit, init, cfg.has_seg)
    empty = row_sum == 0.0
    row_sum_safe = jnp.where(empty, 1.0, row_sum)
    o_ref[...] = (acc / row_sum_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, MASK_VALUE, m + jnp.log2(row_sum_safe))   # base-2 log-sum-exp


def _forward(cfg: _Cfg, q, k, v, qseg, kseg):
    """Padded q [B,Tp,H,Dp], k/v [B,Sp,K,Dp] -> (o [B,Tp,H,Dp], lse2 [B,H,Tp] fp32, base 2)."""
    B, Tp, H, Dp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = H // K
    kc, sch, tables = cfg.plan("fwd")
    bq, bk, nq = kc.block_q, kc.block_k, sch.num_q_blocks
    tabs = [jnp.asarray(t) for t in tables]
    in_specs = [*map(_full_spec, tabs),
                pl.BlockSpec((None, bq, None, Dp), lambda p, b, h: (b, nq - 1 - p, h, 0)),
                pl.BlockSpec((None, Sp, None, Dp), lambda p, b, h: (b, 0, lax.div(h, G), 0)),
                pl.BlockSpec((None, Sp, None, Dp), lambda p, b, h: (b, 0, lax.div(h, G), 0)),
                None if qseg is None else pl.BlockSpec((None, bq), lambda p, b, h: (b, nq - 1 - p)),
                None if kseg is None else pl.BlockSpec((None, Sp), lambda p, b, h: (b, 0))]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, bq=bq, bk=bk, nq=nq, n_tab=len(tabs)),
        grid=(nq, B, H),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, Dp), lambda p, b, h: (b, nq - 1 - p, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda p, b, h: (b, h, nq - 1 - p))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dp), q.dtype),
                   jax.ShapeDtypeStruct((B, H, Tp), F32)],
        compiler_params=cfg.params("fwd"),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*tabs, q, k, v, qseg, kseg)
