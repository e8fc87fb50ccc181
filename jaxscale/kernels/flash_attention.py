"""FlashAttention forward and backward as Pallas kernels (Triton on NVIDIA GPUs, interpret on CPU).

This module holds the public call, `flash_attention`: it pads q, k, v to whole blocks (and
head_dim to a power of two) and runs the three kernels under one custom VJP, the forward kernel
(`flash_forward.py`: O and the log-sum-exp per row, never the [T, S] scores) and the dQ and
dK/dV kernels of the backward (`flash_backward.py`, FlashAttention-2: P recomputed from the
saved log-sum-exp). `visited_tiles` counts the tiles each kernel's loops visit (FLOP accounting).

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

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.kernels.blockwise import check_inputs, pad_to
from jaxscale.kernels.flash_backward import _backward
from jaxscale.kernels.flash_forward import _Cfg, _forward, _trips

# the tuning API, re-exported: callers configure the kernels through this module
from jaxscale.kernels.flash_tuning import (
    KERNELS,
    BlockSizes,
    Tuning,
    _fallback,
    head_dim_bucket,
    resolve_tuning,
)
from jaxscale.kernels.tiles import BlockSparseMask


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
               segment_ids is not None,
               default_interpret() if interpret is None else bool(interpret), precision)
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
