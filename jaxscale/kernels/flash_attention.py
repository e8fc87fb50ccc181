"""FlashAttention forward and backward as Pallas kernels (Triton on NVIDIA GPUs, interpret on CPU).

Forward: one program per (query block, batch, query head) keeps its q tile, the running row max m,
row sum l and an fp32 accumulator on chip and loops over the key/value tiles the mask allows (the
static `TileSchedule` of `blockwise.py`: causal, sliding-window and block-sparse masks skip whole
tiles; tiles wholly inside the mask skip the element mask too). It writes O and the log-sum-exp per
row, never the [T, S] scores: HBM traffic and memory are O(T·D) per head instead of O(T·S).
Backward (FlashAttention-2): dQ programs loop over key tiles, dK/dV programs loop over the query
tiles (and, for grouped-query attention, over the H/K query heads that share the key/value head),
recomputing P = exp(S - lse) from the saved log-sum-exp: 2.5x the forward FLOPs, no stored P.

GQA/MQA: the BlockSpec index maps read key/value head h // (H/K) directly; K and V are never
repeated. Ragged lengths are padded to whole blocks and masked (head_dim is padded to a power of
two for Triton). Inputs fp32, bf16 or fp16; scores, softmax and accumulators are fp32. Rows that see
no key return zeros. Needs a GPU for speed; `interpret=True` (the default off-GPU) runs the same
kernels through XLA on any backend, which is how the tests check them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxscale.kernels.blockwise import (MASK_VALUE, BlockSparseMask, TileSchedule, check_inputs,
                                        pad_to, tile_schedule)

try:  # the Triton backend of Pallas (deprecated upstream from jax 0.11, still present)
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

LOG2E = math.log2(math.e)
F32 = jnp.float32


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two >= 16): forward, dK/dV pass and dQ pass. They shrink to the
    sequence length (next power of two) for short sequences."""
    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 64

    def fit(self, T: int, S: int, block_mask: BlockSparseMask | None) -> "BlockSizes":
        tq, tk = max(16, pl.next_power_of_2(T)), max(16, pl.next_power_of_2(S))
        out = {}
        for name, size in self.__dict__.items():
            if size < 16 or size & (size - 1):
                raise ValueError(f"block size {name}={size} must be a power of two >= 16")
            is_q = name.startswith("block_q")
            size = min(size, tq if is_q else tk)
            if block_mask is not None:
                size = math.gcd(size, block_mask.block_q if is_q else block_mask.block_k)
                if size < 16 or size & (size - 1):
                    raise ValueError(f"block-sparse mask blocks ({block_mask.block_q}, "
                                     f"{block_mask.block_k}) must be multiples of 16 for the "
                                     f"Pallas kernel (its tiles are powers of two >= 16)")
            out[name] = size
        return replace(self, **out)


@dataclass(frozen=True)
class _Cfg:
    T: int
    S: int
    causal: bool
    window: int | None
    q_offset: int
    scale: float
    block_mask: BlockSparseMask | None
    blocks: BlockSizes
    has_seg: bool
    interpret: bool
    num_warps: int | None
    num_stages: int | None
    precision: lax.Precision | None

    def schedule(self, bq: int, bk: int) -> TileSchedule:
        return tile_schedule(self.T, self.S, bq, bk, causal=self.causal, window=self.window,
                             q_offset=self.q_offset, block_mask=self.block_mask)

    def params(self, head_dim: int, stages: int):
        if self.interpret or pltriton is None:
            return None
        warps = self.num_warps or (4 if head_dim <= 64 else 8)
        return pltriton.CompilerParams(num_warps=warps, num_stages=self.num_stages or stages)


def _dot(a, b, cfg, contract=(1, 1)):
    """2-D matmul with fp32 accumulation; contract=(1,1) is a @ b.T, (1,0) a @ b, (0,0) a.T @ b."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=cfg.precision, preferred_element_type=F32)


def _tile_mask(cfg: _Cfg, q_pos, kv_pos, qseg, kseg):
    """[bq, bk] bool for padded row indices q_pos and key indices kv_pos (padding masked)."""
    d = (q_pos + cfg.q_offset)[:, None] - kv_pos[None, :]
    mask = (kv_pos < cfg.S)[None, :] & (q_pos < cfg.T)[:, None]
    if cfg.causal:
        mask = mask & (d >= 0)
    if cfg.window is not None:
        mask = mask & (d < cfg.window)
    if qseg is not None:
        mask = mask & (qseg[:, None] == kseg[None, :])
    return mask


def _full_spec(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _tables(sch: TileSchedule, transpose: bool):
    if transpose:
        return [jnp.asarray(sch.q_index), jnp.asarray(sch.q_count)[None], jnp.asarray(sch.q_full)[None]]
    return [jnp.asarray(sch.kv_index), jnp.asarray(sch.kv_count)[None], jnp.asarray(sch.kv_full)[None]]


def _two_phase_loop(index_ref, count_ref, full_ref, r, visit, carry, masked_full: bool):
    """Visit the tiles listed for row r: full tiles first (element mask only if segment ids), then
    the partial ones with the element mask."""
    n_full, n_all = full_ref[0, r], count_ref[0, r]
    carry = lax.fori_loop(0, n_full, lambda n, c: visit(index_ref[r, n], c, masked_full), carry)
    return lax.fori_loop(n_full, n_all, lambda n, c: visit(index_ref[r, n], c, True), carry)


# ----------------------------------------------------------------------------- forward
def _fwd_kernel(kv_index_ref, kv_count_ref, kv_full_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref,
                o_ref, lse_ref, *, cfg: _Cfg, bq: int, bk: int):
    i = pl.program_id(0)
    q = q_ref[...]                                          # [bq, Dp]
    q_pos = i * bq + jnp.arange(bq)
    qseg = None if qseg_ref is None else qseg_ref[...]
    qk_scale = cfg.scale * LOG2E                            # exp2 domain

    def visit(j, carry, masked):
        m, l, acc = carry
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
        return m_new, alpha * l + jnp.sum(p, axis=1), acc

    init = (jnp.full((bq,), MASK_VALUE, F32), jnp.zeros((bq,), F32),
            jnp.zeros((bq, q.shape[-1]), F32))
    m, l, acc = _two_phase_loop(kv_index_ref, kv_count_ref, kv_full_ref, i, visit, init, cfg.has_seg)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, MASK_VALUE, m + jnp.log2(l_safe))   # base-2 log-sum-exp


def _forward(cfg: _Cfg, q, k, v, qseg, kseg):
    """Padded q [B,Tp,H,Dp], k/v [B,Sp,K,Dp] -> (o [B,Tp,H,Dp], lse2 [B,H,Tp] fp32, base 2)."""
    B, Tp, H, Dp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = H // K
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    sch = cfg.schedule(bq, bk)
    tables = _tables(sch, transpose=False)
    in_specs = [*map(_full_spec, tables),
                pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
                pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0)),
                pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0)),
                None if qseg is None else pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                None if kseg is None else pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0))]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, bq=bq, bk=bk),
        grid=(sch.num_q_blocks, B, H),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dp), q.dtype),
                   jax.ShapeDtypeStruct((B, H, Tp), F32)],
        compiler_params=cfg.params(Dp, stages=3),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*tables, q, k, v, qseg, kseg)


# ----------------------------------------------------------------------------- backward
def _dq_kernel(kv_index_ref, kv_count_ref, kv_full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               delta_ref, qseg_ref, kseg_ref, dq_ref, *, cfg: _Cfg, bq: int, bk: int):
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]                        # [bq, Dp]
    lse, delta = lse_ref[...], delta_ref[...]              # [bq]
    q_pos = i * bq + jnp.arange(bq)
    qseg = None if qseg_ref is None else qseg_ref[...]

    def visit(j, dq, masked):
        rows = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k, v = k_ref[rows, :], v_ref[rows, :]
        p = jnp.exp2(_dot(q, k, cfg) * (cfg.scale * LOG2E) - lse[:, None])
        if masked:
            kseg = None if kseg_ref is None else kseg_ref[rows]
            p = jnp.where(_tile_mask(cfg, q_pos, j * bk + jnp.arange(bk), qseg, kseg), p, 0.0)
        ds = p * (_dot(do, v, cfg) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, cfg, (1, 0))

    dq = _two_phase_loop(kv_index_ref, kv_count_ref, kv_full_ref, i, visit,
                         jnp.zeros(q.shape, F32), cfg.has_seg)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_index_ref, q_count_ref, q_full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                 delta_ref, qseg_ref, kseg_ref, dk_ref, dv_ref, *, cfg: _Cfg, bq: int, bk: int,
                 group: int):
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]                          # [bk, Dp]
    kv_pos = j * bk + jnp.arange(bk)
    kseg = None if kseg_ref is None else kseg_ref[...]

    def visit(i, carry, masked, g):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]      # [bq, Dp] of query head g of the group
        lse, delta = lse_ref[g, rows], delta_ref[g, rows]
        p = jnp.exp2(_dot(q, k, cfg) * (cfg.scale * LOG2E) - lse[:, None])   # [bq, bk]
        if masked:
            qseg = None if qseg_ref is None else qseg_ref[rows]
            p = jnp.where(_tile_mask(cfg, i * bq + jnp.arange(bq), kv_pos, qseg, kseg), p, 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, cfg, (0, 0))
        ds = p * (_dot(do, v, cfg) - delta[:, None])
        return dk + _dot(ds.astype(q.dtype), q, cfg, (0, 0)), dv

    def head(g, carry):
        return _two_phase_loop(q_index_ref, q_count_ref, q_full_ref, j,
                               lambda i, c, masked: visit(i, c, masked, g), carry, cfg.has_seg)

    zeros = jnp.zeros(k.shape, F32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(cfg: _Cfg, q, k, v, qseg, kseg, o, lse, do):
    B, Tp, H, Dp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = H // K
    bl = cfg.blocks
    delta = jnp.einsum("bthd,bthd->bht", o.astype(F32), do.astype(F32))   # rowsum(dO * O)

    sch = cfg.schedule(bl.block_q_dq, bl.block_k_dq)
    bq, bk = bl.block_q_dq, bl.block_k_dq
    tables = _tables(sch, transpose=False)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, bq=bq, bk=bk),
        grid=(sch.num_q_blocks, B, H),
        in_specs=[*map(_full_spec, tables),
                  pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
                  pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0)),
                  pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0)),
                  pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
                  pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
                  pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
                  None if qseg is None else pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                  None if kseg is None else pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0))],
        out_specs=pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=cfg.params(Dp, stages=2),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(*tables, q, k, v, do, lse, delta, qseg, kseg)

    sch = cfg.schedule(bl.block_q_dkv, bl.block_k_dkv)
    bq, bk = bl.block_q_dkv, bl.block_k_dkv
    tables = _tables(sch, transpose=True)
    # one program per (key block, batch, kv head); it reads the G query heads of its group
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, bq=bq, bk=bk, group=G),
        grid=(sch.num_k_blocks, B, K),
        in_specs=[*map(_full_spec, tables),
                  pl.BlockSpec((None, Tp, G, Dp), lambda j, b, kh: (b, 0, kh, 0)),
                  pl.BlockSpec((None, bk, None, Dp), lambda j, b, kh: (b, j, kh, 0)),
                  pl.BlockSpec((None, bk, None, Dp), lambda j, b, kh: (b, j, kh, 0)),
                  pl.BlockSpec((None, Tp, G, Dp), lambda j, b, kh: (b, 0, kh, 0)),
                  pl.BlockSpec((None, G, Tp), lambda j, b, kh: (b, kh, 0)),
                  pl.BlockSpec((None, G, Tp), lambda j, b, kh: (b, kh, 0)),
                  None if qseg is None else pl.BlockSpec((None, Tp), lambda j, b, kh: (b, 0)),
                  None if kseg is None else pl.BlockSpec((None, bk), lambda j, b, kh: (b, j))],
        out_specs=[pl.BlockSpec((None, bk, None, Dp), lambda j, b, kh: (b, j, kh, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=cfg.params(Dp, stages=2),
        interpret=cfg.interpret,
        name="flash_attention_dkdv",
    )(*tables, q, k, v, do, lse, delta, qseg, kseg)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_padded(cfg: _Cfg, q, k, v, qseg, kseg):
    return _forward(cfg, q, k, v, qseg, kseg)[0]


def _flash_padded_fwd(cfg, q, k, v, qseg, kseg):
    o, lse = _forward(cfg, q, k, v, qseg, kseg)
    return o, (q, k, v, qseg, kseg, o, lse)


def _flash_padded_bwd(cfg, res, do):
    q, k, v, qseg, kseg, o, lse = res
    dq, dk, dv = _backward(cfg, q, k, v, qseg, kseg, o, lse, do)
    return dq, dk, dv, None, None


_flash_padded.defvjp(_flash_padded_fwd, _flash_padded_bwd)


# ----------------------------------------------------------------------------- public entry point
def default_interpret() -> bool:
    """Interpret (run the kernel body through XLA) unless the default backend is a GPU."""
    return jax.default_backend() != "gpu"


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None,
                    window: int | None = None, block_mask: BlockSparseMask | None = None,
                    q_offset: int = 0, scale: float | None = None,
                    block_sizes: BlockSizes = BlockSizes(), interpret: bool | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    precision: lax.Precision | None = None):
    """FlashAttention, q [B,T,H,D], k/v [B,S,K,D] -> [B,T,H,D] (differentiable, custom VJP).

    causal / window: query t (at position t + q_offset) sees keys s with s <= t + q_offset and
    s > t + q_offset - window. segment_ids [B,T] (kv_segment_ids [B,S], default the same): packed
    sequences, a query sees only keys with its id. block_mask: static `BlockSparseMask`; kernel
    tiles shrink to divide its blocks. precision: matmul precision (fp32 inputs on a GPU use TF32
    unless `lax.Precision.HIGHEST`). interpret: default True unless the backend is a GPU.
    """
    kv_segment_ids = check_inputs(q, k, v, segment_ids, kv_segment_ids, window)
    B, T, H, D = q.shape
    S = k.shape[1]
    blocks = block_sizes.fit(T, S, block_mask)
    # powers of two: padding to the largest block of each axis suits all three kernels
    q_unit = max(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    k_unit = max(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    Tp, Sp = -(-T // q_unit) * q_unit, -(-S // k_unit) * k_unit
    Dp = max(16, pl.next_power_of_2(D))
    cfg = _Cfg(T, S, bool(causal), window, int(q_offset),
               float(D ** -0.5 if scale is None else scale), block_mask, blocks,
               segment_ids is not None, default_interpret() if interpret is None else bool(interpret),
               num_warps, num_stages, precision)
    qseg = None if segment_ids is None else pad_to(segment_ids.astype(jnp.int32), Tp, 1, -1)
    kseg = None if kv_segment_ids is None else pad_to(kv_segment_ids.astype(jnp.int32), Sp, 1, -2)
    q_p = pad_to(pad_to(q, Tp, 1), Dp, 3)                    # [B, Tp, H, Dp]
    k_p = pad_to(pad_to(k, Sp, 1), Dp, 3)                    # [B, Sp, K, Dp]
    v_p = pad_to(pad_to(v, Sp, 1), Dp, 3)
    o_BTHD = _flash_padded(cfg, q_p, k_p, v_p, qseg, kseg)
    return o_BTHD[:, :T, :, :D]


def visited_tiles(T: int, S: int, *, causal: bool, window: int | None = None,
                  block_mask: BlockSparseMask | None = None,
                  block_sizes: BlockSizes = BlockSizes()) -> dict:
    """Tiles the forward kernel visits vs the dense count, for FLOP accounting."""
    blocks = block_sizes.fit(T, S, block_mask)
    sch = tile_schedule(T, S, blocks.block_q, blocks.block_k, causal=causal, window=window,
                        block_mask=block_mask)
    return {"visited": sch.visited, "full": sch.full, "dense": sch.dense,
            "block_q": blocks.block_q, "block_k": blocks.block_k}
