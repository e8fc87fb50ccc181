"""Attention dispatch: the model's attention implementation is a config choice.

- `xla`: any backend; scores materialised, O(B·H·T·S) memory. The reference.
- `blockwise`: any backend; tiled jnp loops with online softmax, O(B·H·T·D) memory
  (`kernels/blockwise.py`).
- `pallas`: FlashAttention kernels (`kernels/flash_attention.py`), Triton on NVIDIA GPUs; interpret
  mode elsewhere (slow, for tests). O(B·H·T·D) memory.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPU only, bf16/fp16.
- `auto`: picks one of the above, as follows.

`auto`: on a CUDA GPU, `cudnn` when it accepts the call (bf16/fp16, head_dim a multiple of 8 and
<= 128, or <= 256 on Hopper and later, no packed segment ids, no non-causal window), else `pallas`.
On CPU (or any other backend) `xla` while the score matrix is small (T·S <= AUTO_XLA_MAX_SCORES =
512², where neither wins clearly: blockwise takes 0.4-1.5x xla's time, slowest non-causal) and
`blockwise` beyond: measured on CPU (forward+backward, H=8, D=64), blockwise takes 0.3-0.5x xla's
time from T=1k on (it skips masked tiles and never writes the [T, S] probabilities) and its memory
is linear; see experiments/24_flash_attention.py (speed table) and docs/attention.md.

Sharding: `xla` and `blockwise` are plain jnp and partition under GSPMD. A Pallas call is opaque to
GSPMD (it would be replicated), so under `axes.use_rules` `pallas` runs inside `jax.shard_map` over
the mesh axes of the logical `batch` and `heads`/`kv_heads` axes (each device: its batch rows and
its query heads with their own kv heads); if kv heads are not split like the query heads, heads
stay whole. The sequence stays whole per device unless the rules split it over `sp`: then the
implementation registered for the rules' `context` seam runs (ring, Ulysses or all-gather
attention, `jaxscale.strategies.sp`), each of its blocks on one of the implementations here.
All implementations share the reference semantics of `kernels/reference.py`: fp32 softmax, GQA
without repeating K/V, rows with no allowed key give zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale import axes
from jaxscale.hooks import implementation as seam
from jaxscale.kernels.reference import reference_attention

IMPLEMENTATIONS = ("xla", "blockwise", "cudnn", "pallas")

#: `auto` off-GPU keeps `xla` up to this many scores per (batch, head) (512 x 512).
AUTO_XLA_MAX_SCORES = 512 * 512


def _on_cuda_gpu() -> bool:
    if jax.default_backend() != "gpu":
        return False
    try:
        return "cuda" in jax.devices()[0].client.platform_version.lower()
    except Exception:  # pragma: no cover - unknown client; assume NVIDIA when the backend is gpu
        return True


def _cudnn_unsupported(q, k, segment_ids, window, causal) -> str | None:
    """Why `cudnn` cannot take this call (None when it can)."""
    if not _on_cuda_gpu():
        return (f"attention implementation 'cudnn' needs an NVIDIA GPU (cuDNN flash attention); "
                f"the backend here is {jax.default_backend()!r}. Use 'blockwise' (portable, memory "
                f"linear in sequence length), 'xla' (reference), 'pallas' (Triton kernel; "
                f"interpret mode off-GPU) or 'auto'.")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cudnn attention needs bf16 or fp16 inputs, got {q.dtype}; cast, or use 'pallas'"
    D = q.shape[-1]
    d_max = 256 if _hopper_or_later() else 128
    if D % 8 or D > d_max:
        return f"cudnn attention needs head_dim a multiple of 8 and <= {d_max}, got {D}"
    if window is not None and not causal:
        return "cudnn supports a sliding window only together with causal masking"
    if k.shape[1] != q.shape[1] and causal:
        return "cudnn causal masking here assumes T == S"
    return None


def _hopper_or_later() -> bool:
    try:
        return float(jax.devices()[0].compute_capability) >= 9.0
    except Exception:
        return False


def _cudnn(q, k, v, *, causal, segment_ids, window):
    reason = _cudnn_unsupported(q, k, segment_ids, window, causal)
    if reason:
        raise ValueError(reason)
    mask = None
    if segment_ids is not None:  # cuDNN takes this as a bias: O(T·S) memory, prefer pallas
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]   # [B, 1, T, S]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=causal, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0))


def _pallas(q, k, v, *, causal, segment_ids, window):
    """Pallas FlashAttention, inside shard_map over batch and heads when rules are active."""
    from jaxscale.kernels.flash_attention import flash_attention
    kernel = functools.partial(flash_attention, causal=causal, window=window)
    ctx = axes.active()
    if ctx is None:
        return kernel(q, k, v, segment_ids=segment_ids)
    mesh, rules = ctx
    q_spec = rules.spec(("batch", None, "heads", None))
    kv_spec = rules.spec(("batch", None, "kv_heads", None))
    if q_spec[2] != kv_spec[2]:  # GQA groups would straddle devices: keep heads whole
        q_spec, kv_spec = P(q_spec[0], None, None, None), P(kv_spec[0], None, None, None)
    if all(a is None for a in (*q_spec, *kv_spec)):
        return kernel(q, k, v, segment_ids=segment_ids)
    seg_spec = P(q_spec[0], None)
    if segment_ids is None:
        body = lambda q, k, v: kernel(q, k, v)  # noqa: E731
        specs, args = (q_spec, kv_spec, kv_spec), (q, k, v)
    else:
        body = lambda q, k, v, s: kernel(q, k, v, segment_ids=s)  # noqa: E731
        specs, args = (q_spec, kv_spec, kv_spec, seg_spec), (q, k, v, segment_ids)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def choose(implementation: str, T: int, S: int, *, gpu: bool, cudnn: bool = True) -> str:
    """What `implementation` means for T queries and S keys: itself unless `auto`, which is, on
    an NVIDIA GPU, `cudnn` when it accepts the call (`cudnn`) else `pallas`, and elsewhere `xla`
    up to `AUTO_XLA_MAX_SCORES` scores per (batch, head), `blockwise` beyond. The one rule
    behind the model's choice (`resolve`), a context-parallel hop's and the planner's."""
    if implementation not in IMPLEMENTATIONS + ("auto",):
        raise ValueError(f"unknown attention implementation {implementation!r}; "
                         f"valid: {', '.join(IMPLEMENTATIONS + ('auto',))}")
    if implementation != "auto":
        return implementation
    if gpu:
        return "cudnn" if cudnn else "pallas"
    return "xla" if T * S <= AUTO_XLA_MAX_SCORES else "blockwise"


def resolve(implementation: str, q, k, *, causal: bool = True, segment_ids=None,
            window: int | None = None) -> str:
    """The concrete implementation `implementation` means for these inputs on this backend."""
    gpu = _on_cuda_gpu()
    cudnn = gpu and segment_ids is None and \
        _cudnn_unsupported(q, k, segment_ids, window, causal) is None
    return choose(implementation, q.shape[1], k.shape[1], gpu=gpu, cudnn=cudnn)


def attention(q, k, v, *, causal: bool = True, segment_ids=None, window: int | None = None,
              implementation: str = "xla"):
    """q [B, T, H, D], k/v [B, S, K, D] -> [B, T, H, D]; see the module docstring for choices.

    Under rules that split the sequence over `sp` (context parallelism), the tokens are in the
    zig-zag layout and attention runs by the rules' `context` seam (`plan.context`), each hop or
    head group on `implementation`."""
    context = seam("context")
    if context is not None:
        if window is not None:
            raise ValueError("a sliding window is not supported with context parallelism "
                             "(mesh.sp > 1): use mesh.sp=1 for windowed attention")
        fn, mesh, rules = context
        return fn(q, k, v, mesh=mesh, rules=rules, causal=causal, segment_ids=segment_ids,
                  implementation=implementation)
    impl = resolve(implementation, q, k, causal=causal, segment_ids=segment_ids, window=window)
    if impl == "xla":
        return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window)
    if impl == "blockwise":
        from jaxscale.kernels.blockwise import blockwise_attention
        return blockwise_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window)
    if impl == "pallas":
        return _pallas(q, k, v, causal=causal, segment_ids=segment_ids, window=window)
    if implementation == "auto":
        try:  # 'auto' falls back to pallas when cuDNN refuses at trace time
            return _cudnn(q, k, v, causal=causal, segment_ids=segment_ids, window=window)
        except (NotImplementedError, ValueError, RuntimeError):
            return _pallas(q, k, v, causal=causal, segment_ids=segment_ids, window=window)
    return _cudnn(q, k, v, causal=causal, segment_ids=segment_ids, window=window)
