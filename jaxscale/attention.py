"""Attention dispatch: the model's attention implementation is a config choice.

`xla` is the reference (materialised scores, memory quadratic in sequence length).
"""
from __future__ import annotations

from jaxscale.kernels.reference import reference_attention

IMPLEMENTATIONS = ("xla",)


def attention(q, k, v, *, causal: bool = True, segment_ids=None, window: int | None = None,
              implementation: str = "xla"):
    """q [B, T, H, D], k/v [B, S, K, D] -> [B, T, H, D]."""
    if implementation == "xla":
        return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window)
    raise ValueError(f"unknown attention implementation {implementation!r}; "
                     f"valid: {', '.join(IMPLEMENTATIONS)}")
