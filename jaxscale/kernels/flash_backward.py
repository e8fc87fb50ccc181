"""Pallas FlashAttention: the backward kernels, dQ and dK/dV (Triton on GPUs, interpret on CPU).

Backward (FlashAttention-2): delta = rowsum(dO·O) is one XLA reduction; the dK/dV kernel, one
program per (key block, batch, kv head), loops over the H/K query heads of its group and, for each,
over the query tiles the mask allows (causal/window/block-sparse skipping as in the forward). It
works on transposed tiles, S^T = K Q^T, P^T, dS^T = P^T ∘ (V dO^T - delta), so that dV += P^T dO and
dK += dS^T Q take their operands as produced (no transpose of a register tile). dQ is either a
separate kernel (per query block over its key tiles: recomputes S and dP, 7 matmuls per tile pair
in all, deterministic) or, with `Tuning.dq_atomic`, accumulated by the dK/dV kernel in fp32 with
atomic adds (5 matmuls per tile pair; the summation order, hence the last bits of dQ, varies from
run to run on a GPU).

The kernels share the forward's static config, loop tables, row loop and tile mask
(`flash_forward.py`); `flash_attention.py` runs them under its custom VJP.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxscale.kernels.flash_forward import (
    F32,
    LOG2E,
    _Cfg,
    _dot,
    _full_spec,
    _row_loop,
    _tile_mask,
    pltriton,
)


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
