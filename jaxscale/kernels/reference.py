"""Reference attention in plain jnp: materialised scores, fp32 softmax. The ground truth for tests.

Shapes: q [B, T, H, D], k and v [B, S, K, D] with H a multiple of K (grouped-query attention: each
group of H/K query heads shares one key/value head; the K/V are never repeated in memory).
"""
from __future__ import annotations

import jax.numpy as jnp


def attention_mask(T: int, S: int, *, causal: bool, window: int | None = None,
                   q_segment_ids=None, kv_segment_ids=None, q_offset: int = 0):
    """Boolean mask [B or 1, T, S]: True where query t may attend to key s.

    Query t sits at absolute position t + q_offset (keys at 0..S-1): causal keeps s <= t + q_offset;
    `window` keeps the last `window` keys (s > t + q_offset - window); segment ids keep equal ids.
    """
    qpos = jnp.arange(T)[:, None] + q_offset
    kpos = jnp.arange(S)[None, :]
    mask = jnp.ones((T, S), bool)
    if causal:
        mask &= kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    mask = mask[None]
    if q_segment_ids is not None:
        kv = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (q_segment_ids[:, :, None] == kv[:, None, :])
    return mask


def reference_attention(q, k, v, *, causal: bool = True, segment_ids=None,
                        window: int | None = None, mask=None, scale: float | None = None):
    """Softmax(q k^T * scale + mask) v with fp32 softmax; rows with no allowed key give zeros."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    if H % K:
        raise ValueError(f"query heads {H} must be a multiple of key/value heads {K}")
    scale = D ** -0.5 if scale is None else scale
    q_BTKGD = q.reshape(B, T, K, H // K, D)
    s_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k,
                         preferred_element_type=jnp.float32) * scale
    m_BTS = attention_mask(T, S, causal=causal, window=window, q_segment_ids=segment_ids)
    if mask is not None:
        m_BTS = m_BTS & mask
    m = m_BTS[:, None, None]
    s_BKGTS = jnp.where(m, s_BKGTS, -jnp.inf)
    row_max = jnp.max(s_BKGTS, axis=-1, keepdims=True)
    p = jnp.exp(s_BKGTS - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.where(m, p, 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    o_BTKGD = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v,
                         preferred_element_type=jnp.float32)
    return o_BTKGD.reshape(B, T, H, D).astype(q.dtype)
