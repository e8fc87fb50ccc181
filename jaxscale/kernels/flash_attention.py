"""FlashAttention forward and backward as Pallas kernels (Triton on NVIDIA GPUs, interpret on CPU).

Forward: one program per (query block, batch, query head) keeps its q tile, the running row max m,
row sum l and an fp32 accumulator on chip and loops over the key/value tiles the mask allows (the
static `TileSchedule` of `blockwise.py`: causal, sliding-window and block-sparse masks skip whole
tiles; tiles wholly inside the mask skip the element mask too). It writes O and the log-sum-exp per
row, never the [T, S] scores: HBM traffic and memory are O(T·D) per head instead of O(T·S).

Loops: without a block-sparse mask the tiles of a row are one contiguous run of blocks whose full
tiles are a contiguous sub-run, so a program reads four numbers (first, first full, end of full,
end) and its loops address K/V (or Q/dO) affinely in the loop counter, which Triton can software-
pipeline; block-sparse masks walk index lists instead. Query-block programs are launched in reverse
block order, so under a causal mask the longest rows start first.

Backward (FlashAttention-2): delta = rowsum(dO·O) is one XLA reduction; the dK/dV kernel, one
program per (key block, batch, kv head), loops over the H/K query heads of its group and, for each,
over the query tiles the mask allows (causal/window/block-sparse skipping as in the forward). It
works on transposed tiles, S^T = K Q^T, P^T, dS^T = P^T ∘ (V dO^T - delta), so that dV += P^T dO and
dK += dS^T Q take their operands as produced (no transpose of a register tile). dQ is either a
separate kernel (per query block over its key tiles: recomputes S and dP, 7 matmuls per tile pair
in all, deterministic) or, with `Tuning.dq_atomic`, accumulated by the dK/dV kernel in fp32 with
atomic adds (5 matmuls per tile pair; the summation order, hence the last bits of dQ, varies from
run to run on a GPU).

Tuning: each kernel's tile (block_q x block_k), warps and stages, and the dQ mode, come from
`flash_tuning.json` beside this file, keyed by head-dim bucket (head_dim rounded up to a power of
two), causality and dtype (`lookup_tuning`: the exact entry, else the nearest). Explicit arguments
win: `block_sizes` replaces the tiles, `num_warps`/`num_stages` the launch settings of all three
kernels, `tuning` the whole entry. The shipped entries are defaults from FlashAttention-2 and
Triton practice on Hopper, marked "source": "default ..." until a sweep on a GPU replaces them:
`python experiments/gpu_flash_bench.py --tune` times candidate configurations against cuDNN and
rewrites the entries it measured, with the device, date, jax version and timings; `--compile-report`
shows registers, spills and shared memory of the candidates without a GPU (docs/attention.md).
`JAXSCALE_FLASH_TUNING=/path/table.json` points the kernels at another table.

GQA/MQA: the BlockSpec index maps read key/value head h // (H/K) directly; K and V are never
repeated. Ragged lengths are padded to whole blocks and masked (head_dim is padded to a power of
two for Triton). Inputs fp32, bf16 or fp16; scores, softmax and accumulators are fp32. Rows that see
no key return zeros. Needs a GPU for speed; `interpret=True` (the default off-GPU) runs the same
kernels through XLA on any backend, which is how the tests check them.
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

from jaxscale.kernels.blockwise import (MASK_VALUE, BlockSparseMask, TileSchedule, check_inputs,
                                        pad_to, tile_schedule)
# the tuning API, re-exported: callers configure the kernels through this module
from jaxscale.kernels.flash_tuning import (KERNELS, TUNING_ENV, TUNING_TABLE,  # noqa: F401
                                           BlockSizes, KernelConfig, Tuning, head_dim_bucket,
                                           _fallback, load_tuning_table, lookup_tuning,
                                           resolve_tuning)

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

    def plan(self, kernel: str) -> tuple[KernelConfig, TileSchedule, list[np.ndarray]]:
        """The kernel's tile, its schedule and the loop tables its programs read."""
        kc = getattr(self.tuning, kernel)
        sch = tile_schedule(self.T, self.S, kc.block_q, kc.block_k, causal=self.causal,
                            window=self.window, q_offset=self.q_offset, block_mask=self.block_mask)
        return kc, sch, _row_tables(sch, kernel == "dkdv", contiguous=self.block_mask is None)

    def params(self, kernel: str):
        if self.interpret or pltriton is None:
            return None
        kc = getattr(self.tuning, kernel)
        return pltriton.CompilerParams(num_warps=kc.num_warps, num_stages=kc.num_stages)


def _row_tables(sch: TileSchedule, transpose: bool, contiguous: bool) -> list[np.ndarray]:
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
                raise AssertionError(f"row {r} of the tile schedule is not contiguous: {cols}")
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
    m, l, acc = _row_loop(tabs, i, visit, init, cfg.has_seg)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, MASK_VALUE, m + jnp.log2(l_safe))   # base-2 log-sum-exp


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


# ----------------------------------------------------------------------------- backward
def _dq_kernel(*refs, cfg: _Cfg, bq: int, bk: int, nq: int, n_tab: int):
    tabs = refs[:n_tab]
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, dq_ref = refs[n_tab:]
    i = nq - 1 - pl.program_id(0)                           # longest rows first
    q, do = q_ref[...], do_ref[...]                        # [bq, Dp]
    lse, delta = lse_ref[...], delta_ref[...]              # [bq]
    q_pos = i * bq + jnp.arange(bq)
    qseg = None if qseg_ref is None else qseg_ref[...]

    def visit(j, dq, masked):
        rows = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k, v = k_ref[rows, :], v_ref[rows, :]
        p = jnp.exp2(_dot(q, k, cfg) * (cfg.scale * LOG2E) - lse[:, None])   # [bq, bk]
        if masked:
            kseg = None if kseg_ref is None else kseg_ref[rows]
            p = jnp.where(_tile_mask(cfg, q_pos, j * bk + jnp.arange(bk), qseg, kseg), p, 0.0)
        ds = p * (_dot(do, v, cfg) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, cfg, (1, 0))

    dq = _row_loop(tabs, i, visit, jnp.zeros(q.shape, F32), cfg.has_seg)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: _Cfg, bq: int, bk: int, group: int, n_tab: int, atomic: bool):
    tabs = refs[:n_tab]
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, *outs = refs[n_tab:]
    dk_ref, dv_ref, dq_ref = outs[-3:] if atomic else (*outs, None)   # outs[0] aliases dq_ref
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]                          # [bk, Dp]
    kv_pos = j * bk + jnp.arange(bk)
    kseg = None if kseg_ref is None else kseg_ref[...]
    qk_scale = cfg.scale * LOG2E

    def visit(i, carry, masked, g):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]      # [bq, Dp] of query head g of the group
        lse, delta = lse_ref[g, rows], delta_ref[g, rows]  # [bq]
        p_t = jnp.exp2(_dot(k, q, cfg) * qk_scale - lse[None, :])      # P^T [bk, bq]
        if masked:
            qseg = None if qseg_ref is None else qseg_ref[rows]
            p_t = jnp.where(_tile_mask(cfg, i * bq + jnp.arange(bq), kv_pos, qseg, kseg,
                                       kv_major=True), p_t, 0.0)
        dv = dv + _dot(p_t.astype(do.dtype), do, cfg, (1, 0))         # P^T dO   [bk, Dp]
        ds_t = p_t * (_dot(v, do, cfg) - delta[None, :])               # dS^T     [bk, bq]
        if dq_ref is not None:                                        # dQ += dS K (fp32, atomic)
            pltriton.atomic_add(dq_ref, (rows, jnp.int32(g), slice(None)),
                                _dot(ds_t.astype(k.dtype), k, cfg, (0, 0)))
        return dk + _dot(ds_t.astype(q.dtype), q, cfg, (1, 0)), dv    # dS^T Q   [bk, Dp]

    def head(g, carry):
        return _row_loop(tabs, j, lambda i, c, masked: visit(i, c, masked, g), carry, cfg.has_seg)

    zeros = jnp.zeros(k.shape, F32)
    dk, dv = (head(0, (zeros, zeros)) if group == 1 else
              lax.fori_loop(0, group, head, (zeros, zeros)))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(cfg: _Cfg, q, k, v, qseg, kseg, o, lse, do):
    B, Tp, H, Dp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = H // K
    delta = jnp.einsum("bthd,bthd->bht", o.astype(F32), do.astype(F32))   # rowsum(dO * O)
    seg_specs = lambda q_spec, k_spec: [  # noqa: E731
        None if qseg is None else q_spec, None if kseg is None else k_spec]
    # dQ accumulated by atomic adds inside the dK/dV kernel where the tuning asks for it and this
    # jaxlib has Pallas's Triton atomics; otherwise by its own kernel over the key blocks
    atomic = cfg.tuning.dq_atomic and pltriton is not None

    dq = None
    if not atomic:
        kc, sch, tables = cfg.plan("dq")
        bq, bk, nq = kc.block_q, kc.block_k, sch.num_q_blocks
        tabs = [jnp.asarray(t) for t in tables]
        q_blk = pl.BlockSpec((None, bq, None, Dp), lambda p, b, h: (b, nq - 1 - p, h, 0))
        kv_all = pl.BlockSpec((None, Sp, None, Dp), lambda p, b, h: (b, 0, lax.div(h, G), 0))
        row = pl.BlockSpec((None, None, bq), lambda p, b, h: (b, h, nq - 1 - p))
        dq = pl.pallas_call(
            functools.partial(_dq_kernel, cfg=cfg, bq=bq, bk=bk, nq=nq, n_tab=len(tabs)),
            grid=(nq, B, H),
            in_specs=[*map(_full_spec, tabs), q_blk, kv_all, kv_all, q_blk, row, row,
                      *seg_specs(pl.BlockSpec((None, bq), lambda p, b, h: (b, nq - 1 - p)),
                                 pl.BlockSpec((None, Sp), lambda p, b, h: (b, 0)))],
            out_specs=q_blk,
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            compiler_params=cfg.params("dq"),
            interpret=cfg.interpret,
            name="flash_attention_dq",
        )(*tabs, q, k, v, do, lse, delta, qseg, kseg)

    kc, sch, tables = cfg.plan("dkdv")
    bq, bk = kc.block_q, kc.block_k
    tabs = [jnp.asarray(t) for t in tables]
    # one program per (key block, batch, kv head); it reads the G query heads of its group
    q_all = pl.BlockSpec((None, Tp, G, Dp), lambda j, b, kh: (b, 0, kh, 0))
    kv_blk = pl.BlockSpec((None, bk, None, Dp), lambda j, b, kh: (b, j, kh, 0))
    rows = pl.BlockSpec((None, G, Tp), lambda j, b, kh: (b, kh, 0))
    in_specs = [*map(_full_spec, tabs), q_all, kv_blk, kv_blk, q_all, rows, rows,
                *seg_specs(pl.BlockSpec((None, Tp), lambda j, b, kh: (b, 0)),
                           pl.BlockSpec((None, bk), lambda j, b, kh: (b, j)))]
    args = [*tabs, q, k, v, do, lse, delta, qseg, kseg]
    out_specs, out_shape, aliases = [kv_blk, kv_blk], [jax.ShapeDtypeStruct(k.shape, k.dtype),
                                                       jax.ShapeDtypeStruct(v.shape, v.dtype)], {}
    if atomic:  # an fp32 dQ accumulator, zeroed here, aliased to the kernel's third output
        in_specs.append(q_all)
        args.append(jnp.zeros(q.shape, F32))
        out_specs.append(q_all)
        out_shape.append(jax.ShapeDtypeStruct(q.shape, F32))
        aliases = {len(args) - 1 - sum(a is None for a in args): 2}
    outs = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, bq=bq, bk=bk, group=G, n_tab=len(tabs),
                          atomic=atomic),
        grid=(sch.num_k_blocks, B, K),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=cfg.params("dkdv"),
        interpret=cfg.interpret,
        name="flash_attention_dkdv",
    )(*args)
    dk, dv = outs[:2]
    if atomic:
        dq = (outs[2] * cfg.scale).astype(q.dtype)
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
                    block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    precision: lax.Precision | None = None, tuning: Tuning | None = None):
    """FlashAttention, q [B,T,H,D], k/v [B,S,K,D] -> [B,T,H,D] (differentiable, custom VJP).

    causal / window: query t (at position t + q_offset) sees keys s with s <= t + q_offset and
    s > t + q_offset - window. segment_ids [B,T] (kv_segment_ids [B,S], default the same): packed
    sequences, a query sees only keys with its id. block_mask: static `BlockSparseMask`; kernel
    tiles shrink to divide its blocks. precision: matmul precision (fp32 inputs on a GPU use TF32
    unless `lax.Precision.HIGHEST`). interpret: default True unless the backend is a GPU.
    Settings: the tuning table's entry for (head_dim, causal, dtype) unless `tuning` is given;
    `block_sizes`, `num_warps`, `num_stages` override it (see `resolve_tuning`).
    """
    kv_segment_ids = check_inputs(q, k, v, segment_ids, kv_segment_ids, window)
    B, T, H, D = q.shape
    S = k.shape[1]
    tuning = resolve_tuning(D, causal, q.dtype, tuning=tuning, block_sizes=block_sizes,
                            num_warps=num_warps, num_stages=num_stages)
    blocks = tuning.block_sizes().fit(T, S, block_mask)
    # powers of two: padding to the largest block of each axis suits all three kernels
    q_unit = max(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    k_unit = max(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    Tp, Sp = -(-T // q_unit) * q_unit, -(-S // k_unit) * k_unit
    Dp = head_dim_bucket(D)
    cfg = _Cfg(T, S, bool(causal), window, int(q_offset),
               float(D ** -0.5 if scale is None else scale), block_mask, tuning.with_blocks(blocks),
               segment_ids is not None, default_interpret() if interpret is None else bool(interpret),
               precision)
    qseg = None if segment_ids is None else pad_to(segment_ids.astype(jnp.int32), Tp, 1, -1)
    kseg = None if kv_segment_ids is None else pad_to(kv_segment_ids.astype(jnp.int32), Sp, 1, -2)
    q_p = pad_to(pad_to(q, Tp, 1), Dp, 3)                    # [B, Tp, H, Dp]
    k_p = pad_to(pad_to(k, Sp, 1), Dp, 3)                    # [B, Sp, K, Dp]
    v_p = pad_to(pad_to(v, Sp, 1), Dp, 3)
    o_BTHD = _flash_padded(cfg, q_p, k_p, v_p, qseg, kseg)
    return o_BTHD[:, :T, :, :D]


def visited_tiles(T: int, S: int, *, causal: bool, window: int | None = None,
                  block_mask: BlockSparseMask | None = None, q_offset: int = 0,
                  block_sizes: BlockSizes = BlockSizes()) -> dict:
    """Tiles each kernel's loops visit, counted from the loop tables its programs read, vs the
    dense count: the forward's at the top level (FLOP accounting), "dq" and "dkdv" beside it."""
    blocks = block_sizes.fit(T, S, block_mask)
    cfg = _Cfg(T, S, bool(causal), window, int(q_offset), 1.0, block_mask,
               _fallback(64).with_blocks(blocks), False, True, None)
    out = {}
    for kernel in KERNELS:
        kc, sch, tables = cfg.plan(kernel)
        trips, full = _trips(tables)
        out[kernel] = {"visited": int(trips.sum()), "full": int(full.sum()), "dense": sch.dense,
                       "programs_per_head": len(trips), "block_q": kc.block_q,
                       "block_k": kc.block_k}
    return {**out["fwd"], "dq": out["dq"], "dkdv": out["dkdv"]}
