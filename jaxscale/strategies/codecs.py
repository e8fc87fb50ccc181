"""Block codecs of the quantised collectives: a block of fp32 values as a small payload and one
fp32 scale (gradient compression's quantised means, ZeRO++'s weight gathers and gradient
reduce-scatter). No collective of their own: they decide the bytes the collectives that carry
them move, and the rounding that saves those bytes costs (half a level per element: 1/254 of a
block's largest for int8, 1/14 for int4, 2^-4 relative for e4m3)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

CAST = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "int8": jnp.int8}
FP8_MAX, INT8_MAX, INT4_MAX = 448.0, 127.0, 7.0


# ---------------------------------------------------------------------------------------------
# codecs: encode [..., nb, B] fp32 -> (payload [..., nb, bytes per block], scales [..., nb] | None)
# ---------------------------------------------------------------------------------------------
def encode(method: str, x):
    if method == "bf16":
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16), None
    amax = jnp.max(jnp.abs(x), axis=-1)
    if method == "int8":
        scale = amax / INT8_MAX
        safe = jnp.where(scale > 0, scale, 1.0)[..., None]
        return jnp.clip(jnp.round(x / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale
    if method == "fp8":
        scale = amax / FP8_MAX
        safe = jnp.where(scale > 0, scale, 1.0)[..., None]
        q = jnp.clip(x / safe, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
        return jax.lax.bitcast_convert_type(q, jnp.uint8), scale
    if method == "int4":        # two values in [-7, 7] per byte, each offset by 8
        scale = amax / INT4_MAX
        safe = jnp.where(scale > 0, scale, 1.0)[..., None]
        q = (jnp.clip(jnp.round(x / safe), -INT4_MAX, INT4_MAX) + 8).astype(jnp.uint8)
        q = q.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
        return q[..., 0] | (q[..., 1] << 4), scale
    if method == "sign":
        scale = jnp.mean(jnp.abs(x), axis=-1)
        bits = (x >= 0).astype(jnp.uint8).reshape(x.shape[:-1] + (x.shape[-1] // 8, 8))
        return jnp.sum(bits << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8), scale
    raise ValueError(f"no codec for method {method!r}")


def decode(method: str, payload, scale):
    if method == "bf16":
        return jax.lax.bitcast_convert_type(payload, jnp.bfloat16).astype(jnp.float32)
    if method == "int8":
        return payload.astype(jnp.float32) * scale[..., None]
    if method == "fp8":
        q = jax.lax.bitcast_convert_type(payload, jnp.float8_e4m3fn)
        return q.astype(jnp.float32) * scale[..., None]
    if method == "int4":
        q = jnp.stack([payload & 15, payload >> 4], axis=-1).astype(jnp.float32) - 8.0
        return q.reshape(payload.shape[:-1] + (payload.shape[-1] * 2,)) * scale[..., None]
    if method == "sign":
        bits = (payload[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
        bits = bits.reshape(payload.shape[:-1] + (payload.shape[-1] * 8,))
        return (2.0 * bits.astype(jnp.float32) - 1.0) * scale[..., None]
    raise ValueError(f"no codec for method {method!r}")
