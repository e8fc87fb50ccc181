"""The LLaMA block's building pieces: parameters with logical axes, RMSNorm, the embedding lookup,
RoPE, the token loss and the SwiGLU MLP. Each with its own backward where the default one would
keep or move more than it needs."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.axes import constrain
from jaxscale.hooks.projection import project, project_columns


def param(rngs: nnx.Rngs, shape, names, dtype, std, init=None):
    """An `nnx.Param` of `shape` initialised N(0, std) (or by `init`), with its logical axes."""
    value = (init or nnx.initializers.normal(std))(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, scale, eps: float):
    """x / rms(x) * scale, computed in fp32, returned in x's dtype.

    The backward keeps only x (in its own dtype: a 16-bit model saves no fp32 copy of the
    residual stream) and the fp32 inverse rms per token, and recomputes the rest."""
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * r * scale.astype(jnp.float32)).astype(x.dtype), (x, scale, r)


def _rms_norm_bwd(eps, res, dy):
    x, scale, r = res
    n = x.astype(jnp.float32) * r                                  # the normalised input
    g = dy.astype(jnp.float32)
    d_scale = jnp.sum(g * n, axis=tuple(range(x.ndim - 1)))
    gn = g * scale.astype(jnp.float32)
    dx = r * (gn - n * jnp.mean(gn * n, axis=-1, keepdims=True))
    return dx.astype(x.dtype), d_scale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


#: vocabularies up to this size take the embedding gradient as a one-hot matmul
ONE_HOT_MAX_VOCAB = 4096


@jax.custom_vjp
def embed_lookup(table_VD, tokens_BT):
    """Rows of the embedding table. The gradient is a matmul of the tokens' one-hot codes with the
    output gradient for small vocabularies (`ONE_HOT_MAX_VOCAB`; a scatter-add of every token
    into a few hundred rows serialises on the rows, as the H200 profile showed), a segment sum
    over the sorted ids otherwise; both accumulate in fp32."""
    return jnp.take(table_VD, tokens_BT, axis=0)


def _embed_fwd(table_VD, tokens_BT):
    # the table's row count and dtype ride along in an empty [V, 0] array, not the table itself
    return jnp.take(table_VD, tokens_BT, axis=0), (tokens_BT, table_VD[:, :0])


def _embed_bwd(res, g_BTD):
    tokens_BT, empty_V0 = res
    V, dtype = empty_V0.shape[0], empty_V0.dtype
    if V <= ONE_HOT_MAX_VOCAB:
        onehot_BTV = jax.nn.one_hot(tokens_BT, V, dtype=g_BTD.dtype)
        d_VD = jnp.einsum("btv,btd->vd", onehot_BTV, g_BTD, preferred_element_type=jnp.float32)
    else:
        ids = tokens_BT.reshape(-1)
        order = jnp.argsort(ids)
        d_VD = jax.ops.segment_sum(g_BTD.reshape(-1, g_BTD.shape[-1])[order].astype(jnp.float32),
                                   ids[order], num_segments=V, indices_are_sorted=True)
    zeros = np.zeros(tokens_BT.shape, jax.dtypes.float0)
    return d_VD.astype(dtype), zeros


embed_lookup.defvjp(_embed_fwd, _embed_bwd)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, *, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("embed",), dtype, 0.0, init=nnx.initializers.ones)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


def rope_frequencies(cfg):
    """RoPE's inverse frequencies of `cfg` (a `ModelConfig`), with Llama-3.1 scaling."""
    hd = cfg.hd
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    s = cfg.rope_scaling
    if s is not None:  # Llama-3.1: keep high frequencies, divide low ones by factor, blend between
        wavelen = 2 * math.pi / inv
        low_wl = s.original_max_position / s.low_freq_factor
        high_wl = s.original_max_position / s.high_freq_factor
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * inv / s.factor + smooth * inv
        inv = jnp.where(wavelen < high_wl, inv,
                        jnp.where(wavelen > low_wl, inv / s.factor, blended))
    return inv


def apply_rope(x_BTHD, positions_BT, inv_freq):
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) (the Hugging Face / Meta 'rotate_half' layout)."""
    ang_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(ang_BTF)[:, :, None, :], jnp.sin(ang_BTF)[:, :, None, :]
    x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BTHD.dtype)


def token_loss(logits_BTV, targets_BT, mask_BT):
    """(sum of the masked tokens' cross entropies, number of real tokens), in fp32.

    The target's logit is picked by a masked sum over the vocabulary, not a gather: the same
    numbers, and a form XLA's SPMD partitioner takes inside a `shard_map` manual over some mesh
    axes while the batch and the vocabulary are split over two others (a gather there fails its
    partitioning check); under vocabulary parallelism it is a local sum plus one all-reduce."""
    logits = logits_BTV.astype(jnp.float32)
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == targets_BT[..., None]
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    mask = mask_BT.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


#: logical axes (x, weight, output) of a SwiGLU's matmuls: from the residual stream into the MLP
#: region (`seq`) and back
RESID = ("batch", "norm_seq", "embed")
MLP_UP = (RESID, ("embed", "mlp"), ("batch", "seq", "mlp"))
MLP_DOWN = (("batch", "seq", "mlp"), ("mlp", "embed"), RESID)


def swiglu(x_BTD, w_gate, w_up, w_down, sites=("w_gate", "w_up", "w_down")):
    """silu(x w_gate) * (x w_up) w_down through the model's weight-matmul hooks at `sites` (gate
    and up as one column group), its activations tagged for the remat policies."""

    g, u = project_columns("btd,df->btf", x_BTD, (w_gate, w_up), sites[:2], (MLP_UP, MLP_UP))
    g, u = checkpoint_name(g, "mlp_gate"), checkpoint_name(u, "mlp_up")
    h_BTF = constrain(checkpoint_name(jax.nn.silu(g) * u, "mlp_hidden"), "batch", "seq", "mlp")
    return checkpoint_name(project("btf,fd->btd", h_BTF, w_down, sites[2], MLP_DOWN), "mlp_down")
