"""The two collectives of Megatron SP's regions, along the sequence over tp: the all-gather of a
column group's input and the reduce-scatter of a row matmul's partial sums, each the other's
transpose.

On XLA:CPU a 16-bit reduce-scatter is summed in f32 here. The backend widens 16-bit reductions
to f32 anyway (its AllReducePromotion pass), and that pass aborts ("Invalid binary instruction
opcode copy") on a reducer that ends in a copy: inside a partly manual region a reducer's add
carries a sharding annotation, which is what this one's becomes (bf16 or fp16 with micro-batches).
Widened first, the program is the one the pass would have made; other backends sum in the
values' own dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp

AXIS = "tp"


def scatter_seq(v, dim: int):
    """psum_scatter over tp along `dim` (tiled)."""
    if jax.default_backend() == "cpu" and v.dtype.itemsize == 2:
        return jax.lax.psum_scatter(v.astype(jnp.float32), AXIS, scatter_dimension=dim,
                                    tiled=True).astype(v.dtype)
    return jax.lax.psum_scatter(v, AXIS, scatter_dimension=dim, tiled=True)


def gather_seq(v, dim: int):
    """all_gather over tp along `dim` (tiled); its transpose is `scatter_seq`."""
    @jax.custom_vjp
    def gather(v):
        return jax.lax.all_gather(v, AXIS, axis=dim, tiled=True)

    def fwd(v):
        return gather(v), None

    def bwd(_, g):
        return (scatter_seq(g, dim),)

    gather.defvjp(fwd, bwd)
    return gather(v)
