"""LLaMA-style decoder in Flax NNX: RMSNorm, RoPE (optional Llama-3.1 scaling), SwiGLU, GQA.

The model knows logical axes only: each weight carries its logical names (`out_sharding`
metadata), activations pass through `constrain(x, "batch", "seq", ...)` (the residual stream
through `"norm_seq"`, the axis sequence parallelism splits), and the activations that
remat/offload policies talk about are tagged with `checkpoint_name` (see `TAGS`). No mesh axis and
no strategy flag appears here; a strategy reaches the layers only through `block_wrapper`, a
function applied to each block's pure `(x, block_state) -> x` function (e.g. `jax.checkpoint`),
and through `jaxscale.hooks.projection` (the weight matmuls, and per-layer inputs the layer loop
carries for them beside the stacked weights: fp8 QAT's scales).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.axes import constrain
from jaxscale.fields import nonneg, one_of, positive, ranged
from jaxscale.fields import problems as field_problems
from jaxscale.hooks.attention import IMPLEMENTATIONS, attention
from jaxscale.hooks.projection import (
    project,
    project_columns,
    scanned_inputs,
    with_layer_input,
)
from jaxscale.models.layers import (
    RESID,
    RMSNorm,
    apply_rope,
    embed_lookup,
    param,
    rope_frequencies,
    swiglu,
)
from jaxscale.models.moe import MoE, summarise

DTYPES = ("float32", "bfloat16", "float16")

#: `checkpoint_name` tags, in the order they appear in a block.
TAGS = ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "o_proj",
        "mlp_norm", "mlp_gate", "mlp_up", "mlp_hidden", "mlp_down")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency scaling of RoPE."""
    factor: float = positive(8.0)
    low_freq_factor: float = positive(1.0)
    high_freq_factor: float = positive(4.0)
    original_max_position: int = positive(8192)

    def relations(self) -> list[str]:
        if self.high_freq_factor <= self.low_freq_factor:
            return [f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must be greater "
                    f"than model.rope_scaling.low_freq_factor={self.low_freq_factor}"]
        return []


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = positive(320)
    dim: int = positive(128)
    n_layers: int = positive(4)
    n_heads: int = positive(8)
    n_kv_heads: int = positive(4)
    ffn_dim: int = positive(384)
    head_dim: int = nonneg(0)         # 0: dim // n_heads
    max_seq_len: int = positive(2048)
    rope_theta: float = positive(10000.0)
    rope_scaling: RopeScaling | None = None
    norm_eps: float = positive(1e-5)
    tie_embeddings: bool = False
    scan_layers: bool = True
    dtype: str = one_of("float32", *DTYPES)          # compute dtype
    param_dtype: str = one_of("float32", *DTYPES)
    attention: str = one_of("auto", "auto", *IMPLEMENTATIONS)   # jaxscale.hooks.attention
    init_std: float = nonneg(0.02)
    moe_experts: int = nonneg(0)      # 0: dense MLP; E: a Mixtral-style mixture of E experts
    moe_top_k: int = positive(2)      # experts per token
    capacity_factor: float = positive(1.25)   # expert capacity = factor x tokens x top_k / E
    moe_every: int = positive(1)      # every n-th layer is a mixture (layers n-1, 2n-1, ...)
    moe_dropless: bool = False        # no capacity: every token reaches its experts (models/moe.py)
    moe_aux_weight: float = nonneg(0.01)     # Switch load-balancing loss weight
    moe_z_weight: float = nonneg(0.001)      # router z-loss weight
    moe_ffn_dim: int = nonneg(0)      # each expert's hidden width; 0: ffn_dim (fine-grained: less)
    moe_shared_experts: int = nonneg(0)      # experts every token passes through (DeepSeek, Qwen)
    moe_bias_rate: float = ranged(0.0, lo=0, below=1, note="the per-expert routing bias's "
                                  "step per update; 0: no bias")   # auxiliary-loss-free
                                      # balancing (DeepSeek-V3): b += rate x sign(mean - load)
    vocab_multiple: int = positive(1)  # embedding and head rows padded to a multiple of this
                                       # (Megatron's make-vocab-size-divisible-by; a plan with
                                       # tensor parallelism raises it to include mesh.tp)

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and columns of the head: `vocab_size` rounded up to a multiple
        of `vocab_multiple`; the logits of the padding are masked out of the softmax."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def expert_ffn(self) -> int:
        """The hidden width of each routed (and each shared) expert."""
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (from 0) is a mixture of experts: every `moe_every`-th layer."""
        return bool(self.moe_experts) and (i + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers // self.moe_every if self.moe_experts else 0

    def moe_capacity(self, seq_len: int) -> int:
        """Slots per expert and sequence: ceil(capacity_factor x T x top_k / E), at most T (an
        expert takes a token at most once); T when dropless (the worst case: none can overflow)."""
        if self.moe_dropless:
            return seq_len
        c = math.ceil(self.capacity_factor * seq_len * self.moe_top_k / self.moe_experts - 1e-9)
        return max(1, min(seq_len, c))

    def relations(self) -> list[str]:
        """The checks relating fields (each field's own range is declared above)."""
        errs = []
        if self.n_heads % self.n_kv_heads:
            errs.append(f"model.n_heads={self.n_heads} must be a multiple of "
                        f"model.n_kv_heads={self.n_kv_heads}")
        if not self.head_dim and self.dim % self.n_heads:
            errs.append(f"model.dim={self.dim} is not divisible by model.n_heads="
                        f"{self.n_heads}; set model.head_dim explicitly")
        elif self.hd % 2:
            errs.append(f"head_dim={self.hd} must be even for RoPE")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            errs.append(f"model.moe_experts={self.moe_experts}, model.moe_top_k="
                        f"{self.moe_top_k}: give 0 experts (dense) or top_k between 1 and "
                        f"the expert count")
        if self.moe_experts and self.moe_every > 1 and self.scan_layers:
            errs.append(f"model.moe_every={self.moe_every} mixes dense and expert layers, but "
                        f"model.scan_layers=true scans one identical layer: set "
                        f"model.scan_layers=false or model.moe_every=1")
        extras = {"moe_ffn_dim": self.moe_ffn_dim, "moe_shared_experts": self.moe_shared_experts,
                  "moe_bias_rate": self.moe_bias_rate}
        for name, v in extras.items():
            if v and not self.moe_experts:
                errs.append(f"model.{name}={v} configures a mixture of experts, but "
                            f"model.moe_experts=0: set model.moe_experts or leave {name} at 0")
        if self.moe_experts and self.moe_shared_experts > self.moe_experts:
            errs.append(f"model.moe_shared_experts={self.moe_shared_experts} exceeds "
                        f"model.moe_experts={self.moe_experts}: shared experts are the few "
                        f"every token passes through beside its routed ones")
        if self.moe_experts and self.moe_every > self.n_layers:
            errs.append(f"model.moe_every={self.moe_every} > model.n_layers={self.n_layers}: "
                        f"no layer would be a mixture of experts")
        return errs

    def validate(self) -> "ModelConfig":
        """Raise one ValueError naming every problem: field ranges, then `relations()`."""
        errs = field_problems(self, "model.")
        if errs:
            raise ValueError("; ".join(errs))
        return self

    def param_count(self, active: bool = False) -> int:
        """Exact number of parameters (embedding, blocks, final norm, untied head); `active`:
        those a token passes through (a mixture of experts counts its top_k experts)."""
        d, f, hd, E = self.dim, self.ffn_dim, self.hd, self.moe_experts
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        dense = 3 * d * f
        fe, shared = self.expert_ffn, self.moe_shared_experts
        moe = ((self.moe_top_k if active else E) + shared) * 3 * d * fe + d * E
        moe += E if self.moe_bias_rate and not active else 0      # the routing bias
        L, Lm = self.n_layers, self.n_moe_layers
        blocks = L * (attn + 2 * d) + (L - Lm) * dense + Lm * moe
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + blocks + d + head

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token: 6 x (non-embedding matmul params + head, active experts
        only) + attention.

        Attention (QK^T and PV, forward 4*s*hd*heads per token per layer, x3 for fwd+bwd) is
        halved when causal, as in the MFU accounting of PaLM / Megatron.
        """
        n_matmul = (self.param_count(active=True)
                    - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1))
        n_matmul -= (2 * self.n_layers + 1) * self.dim      # norms are not matmuls
        attn = 12 * self.n_layers * self.n_heads * self.hd * seq_len
        return 6 * n_matmul + (attn / 2 if causal else attn)


#: the parameter (its path in a block) each weight matmul of a block reads, by its projection
#: site; a mixture of experts' MLP runs its experts on slot buffers, not through these
WEIGHT_OF = {"wq": ("attn", "wq"), "wk": ("attn", "wk"), "wv": ("attn", "wv"),
             "wo": ("attn", "wo"), "w_gate": ("mlp", "w_gate"), "w_up": ("mlp", "w_up"),
             "w_down": ("mlp", "w_down"), "shared_gate": ("mlp", "shared_gate"),
             "shared_up": ("mlp", "shared_up"), "shared_down": ("mlp", "shared_down")}

#: logical axes (x, weight, output) of the weight matmuls: the residual stream (`norm_seq`) in,
#: the attention/MLP regions (`seq`) out, and back (`layers.RESID`, `MLP_UP`, `MLP_DOWN`)
_QKV_NAMES = {h: (RESID, ("embed", h, "head_dim"), ("batch", "seq", h, "head_dim"))
              for h in ("heads", "kv_heads")}
_O_NAMES = (("batch", "seq", "heads", "head_dim"), ("heads", "head_dim", "embed"), RESID)
_HEAD_NAMES = (RESID, ("embed", "vocab"), ("batch", "seq", "vocab"))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, hd, pd = cfg.dim, cfg.hd, jnp.dtype(cfg.param_dtype)
        std = cfg.init_std
        self.wq = param(rngs, (d, cfg.n_heads, hd), ("embed", "heads", "head_dim"), pd, std)
        self.wk = param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), pd, std)
        self.wv = param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), pd, std)
        self.wo = param(rngs, (cfg.n_heads, hd, d), ("heads", "head_dim", "embed"), pd,
                         std / math.sqrt(2 * cfg.n_layers))
        self.cfg = cfg

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, inv_freq):
        q, k, v = project_columns(
            "btd,dhk->bthk", x_BTD, (self.wq[...], self.wk[...], self.wv[...]),
            ("wq", "wk", "wv"), (_QKV_NAMES["heads"],) + (_QKV_NAMES["kv_heads"],) * 2)
        q = constrain(checkpoint_name(q, "q_proj"), "batch", "seq", "heads", "head_dim")
        k = constrain(checkpoint_name(k, "k_proj"), "batch", "seq", "kv_heads", "head_dim")
        v = constrain(checkpoint_name(v, "v_proj"), "batch", "seq", "kv_heads", "head_dim")
        q = apply_rope(q, positions_BT, inv_freq)
        k = apply_rope(k, positions_BT, inv_freq)
        o_BTHK = attention(q, k, v, causal=True, segment_ids=segment_ids_BT,
                           implementation=self.cfg.attention)
        o_BTHK = constrain(checkpoint_name(o_BTHK, "attn_out"), "batch", "seq", "heads", "head_dim")
        out = project("bthk,hkd->btd", o_BTHK, self.wo[...], "wo", _O_NAMES)
        return checkpoint_name(out, "o_proj")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, pd, std = cfg.dim, cfg.ffn_dim, jnp.dtype(cfg.param_dtype), cfg.init_std
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), pd, std)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), pd, std)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), pd, std / math.sqrt(2 * cfg.n_layers))

    def __call__(self, x_BTD):
        return swiglu(x_BTD, self.w_gate[...], self.w_up[...], self.w_down[...])


class Block(nnx.Module):
    """Attention then a feed-forward block: the dense SwiGLU MLP, or with `moe` a mixture of
    experts (`models/moe.py`). Returns (x, router statistics: {} for a dense block)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        pd = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, pd, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, pd, rngs=rngs)
        if moe:
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, rngs=rngs)
        self.moe = moe

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, inv_freq):
        h = checkpoint_name(self.attn_norm(x_BTD), "attn_norm")
        x_BTD = x_BTD + self.attn(h, positions_BT, segment_ids_BT, inv_freq)
        x_BTD = constrain(x_BTD, "batch", "norm_seq", "embed")
        h = checkpoint_name(self.mlp_norm(x_BTD), "mlp_norm")
        out, stats = self.mlp(h) if self.moe else (self.mlp(h), {})
        x_BTD = x_BTD + out
        return constrain(x_BTD, "batch", "norm_seq", "embed"), stats


def _padded(init, dim: int, size: int):
    """`init` drawn at the true vocabulary `size` along `dim` and padded with zeros to the
    shape asked: the same values whatever the padding (a plan's, for tp)."""
    def fn(key, shape, dtype):
        true = shape[:dim] + (size,) + shape[dim + 1:]
        width = [(0, 0)] * len(shape)
        width[dim] = (0, shape[dim] - size)
        return jnp.pad(init(key, true, dtype), width)
    return fn


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        pd = jnp.dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.padded_vocab, cfg.dim), ("vocab", "embed"), pd, 1.0,
                           init=_padded(nnx.initializers.normal(1.0), 0, cfg.vocab_size))
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(r):          # one identical layer, stacked (validate: moe_every=1 if MoE)
                return Block(cfg, rngs=r, moe=cfg.is_moe_layer(0))
            self.layers = make(rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs=rngs, moe=cfg.is_moe_layer(i))
                                    for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, pd, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.dim, cfg.padded_vocab), ("embed", "vocab"), pd,
                              1.0, init=_padded(nnx.initializers.normal(1 / math.sqrt(cfg.dim)),
                                                1, cfg.vocab_size))

    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None,
                 block_wrapper: Callable | None = None, return_aux: bool = False):
        """tokens [B, T] int -> logits [B, T, vocab] in float32; with `return_aux`, (logits,
        the mixture-of-experts statistics of `moe.summarise`: {} for a dense model)."""
        x = self.embed_tokens(tokens_BT)
        x, stats = self.blocks(x, positions_BT, segment_ids_BT, block_wrapper)
        logits = self.logits(x)
        if not return_aux:
            return logits
        if not stats:
            return logits, {}
        return logits, summarise(jax.tree.map(lambda *a: jnp.concatenate(a), *stats))

    # The three parts of the forward, which a pipeline runs on different stages.
    def embed_tokens(self, tokens_BT):
        """tokens [B, T] -> the residual stream [B, T, D] in the compute dtype."""
        # The table is read whole along `embed` (gathered, as any FSDP weight at use); only a
        # vocabulary split survives, which makes the lookup a masked gather plus one all-reduce.
        table_VD = constrain(self.embed[...], "vocab", None)
        x = constrain(embed_lookup(table_VD, tokens_BT).astype(jnp.dtype(self.cfg.dtype)),
                      "batch", "seq", "embed")
        return constrain(x, "batch", "norm_seq", "embed")

    def blocks(self, x_BTD, positions_BT=None, segment_ids_BT=None,
               block_wrapper: Callable | None = None, rows: tuple[int, int] | None = None):
        """The residual stream through the layers (`rows=(start, n)`: only the stacked layers
        start..start+n-1, a pipeline stage's share) -> (x, router statistics: a list, [] if
        dense)."""
        cfg = self.cfg
        B, T = x_BTD.shape[:2]
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        inv_freq = rope_frequencies(cfg)

        def block_fn(x, block_state, graphdef):
            return nnx.merge(graphdef, block_state)(x, positions_BT, segment_ids_BT, inv_freq)

        wrap = block_wrapper or (lambda f: f)
        side = scanned_inputs(rows)      # per-layer inputs of the plan's projection, or None
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)
            if rows is not None:
                state = jax.tree.map(lambda a: a[rows[0]:rows[0] + rows[1]], state)
            body = with_layer_input(wrap(lambda x, st: block_fn(x, st, graphdef)))
            x_BTD, stats = jax.lax.scan(body, x_BTD, (state, side))   # stats: stacked [L, ...]
            return x_BTD, [stats] if stats else []
        if rows is not None:
            raise ValueError("a share of the layers (rows=) needs model.scan_layers=true")
        stats = []
        for i, blk in enumerate(self.layers):
            graphdef, state = nnx.split(blk)
            body = with_layer_input(wrap(lambda x, st, g=graphdef: block_fn(x, st, g)))
            x_BTD, st = body(x_BTD, (state, jax.tree.map(lambda a: a[i], side)))
            stats += [jax.tree.map(lambda a: a[None], st)] if st else []
        return x_BTD, stats

    def logits(self, x_BTD):
        """The final norm and the LM head: [B, T, D] -> logits [B, T, padded vocab] in float32
        (the padding's at -1e30: nothing of the softmax)."""
        x = self.norm(x_BTD)
        head = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
        logits = project("btd,dv->btv", x.astype(jnp.dtype(self.cfg.dtype)), head, "head",
                         _HEAD_NAMES, preferred_element_type=jnp.float32)
        if self.cfg.padded_vocab > self.cfg.vocab_size:      # no token is the padding
            real = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) < self.cfg.vocab_size
            logits = jnp.where(real, logits, jnp.float32(-1e30))
        return constrain(logits, "batch", "seq", "vocab")
