"""Activation memory of jaxscale's LLaMA block: the tensors the backward pass keeps, per layer.

Derivation. The residuals of one block's VJP are what `jax.ad_checkpoint.print_saved_residuals`
lists for `Block.__call__` (models/llama.py); XLA then merges duplicates. What the compiled
train step keeps (read from the stacked outputs of the forward `while` loop of
`jaxscale inspect`'s HLO, identical on all of dp8, fsdp8, tp8 and dp2xfsdp2xtp2) is, per token
and layer, with d = dim, H/K = query/kv heads, hd = head_dim, f = ffn_dim, s = sequence length,
beta = compute dtype bytes:

| tensor                         | elements      | bytes  | split by        |
|--------------------------------|---------------|--------|-----------------|
| layer input x                  | d             | beta   | residual stream |
| attn_norm output h             | d             | beta   | residual stream |
| q after RoPE                   | H hd          | beta   | tp              |
| k after RoPE, v                | 2 K hd        | beta   | tp              |
| attention scores, 4 buffers    | 4 H s         | 4      | tp (xla only)   |
| attn_out (P V)                 | H hd          | beta   | tp              |
| x after attention residual     | d             | beta   | residual stream |
| mlp_norm output                | d             | beta   | residual stream |
| gate, up                       | 2 f           | beta   | tp              |
| silu chain (sigmoid, silu, ')  | 3 f           | beta   | tp              |
| hidden = silu(gate) * up       | f             | beta   | tp              |
| RMSNorm statistics (1 / rms)   | 2             | 4      | residual stream |
| softmax statistics             | 4 H (fused: H)| 4      | tp              |

The four score-sized fp32 buffers are the masked scores, their exponentials, the masked and the
normalised probabilities of `kernels/reference.py` (JAX saves seven, XLA keeps four). A fused
attention (`blockwise`, `pallas`, `cudnn`) keeps none of them, only O(s) statistics. For
d = H hd, fp32 and K = H/2 this is 4 sbh (4 + 2 + 1 + 6 f/d) + 16 a s^2 b bytes per layer; for
the `tiny` model (f = 3d) 4 sbh x 25 + 16 a s^2 b. The RMSNorm keeps only its input (in the
compute dtype) and one fp32 statistic per token (`jaxscale.models.layers.rms_norm`'s backward
recomputes the rest): no fp32 copy of the residual stream in a 16-bit model. Compare Korthikanti et
al. (arXiv 2205.05198) for a GPT block in 16 bits: sbh (34 + 5 a s / h) (see `gpt.py`).

Splits. "residual stream" tensors are replicated over `tp` unless Megatron sequence parallelism
splits them over `tp` too; "tp" tensors are split t ways; context parallelism over `sp` splits
every token-indexed tensor sp ways (the scores keep their full key length s).

Remat policies (`plan.remat`, `jaxscale.strategies.remat`, over the model's `checkpoint_name` tags):
`none` keeps the table; `full` keeps only the layer input; `save_dots` keeps the layer input and
the outputs of the weight matmuls (q, k, v, o_proj, gate, up, down: JAX's
`dots_with_no_batch_dims_saveable`); `save_attention_out` keeps the layer input and `attn_out`;
`offload` moves those matmul outputs and `attn_out` to host memory; a custom
`"name:save|remat|offload,..."` keeps / offloads the named tags. A rematerialised block holds one
layer's full activations again while its backward runs (the recompute working set).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: tag -> (elements per token as a function of the model, split region)
_TAG_SIZES = {
    "attn_norm": (lambda m: m.dim, "res"), "q_proj": (lambda m: m.n_heads * m.hd, "tp"),
    "k_proj": (lambda m: m.n_kv_heads * m.hd, "tp"),
    "v_proj": (lambda m: m.n_kv_heads * m.hd, "tp"),
    "attn_out": (lambda m: m.n_heads * m.hd, "tp"), "o_proj": (lambda m: m.dim, "res"),
    "mlp_norm": (lambda m: m.dim, "res"), "mlp_gate": (lambda m: m.ffn_dim, "tp"),
    "mlp_up": (lambda m: m.ffn_dim, "tp"), "mlp_hidden": (lambda m: m.ffn_dim, "tp"),
    "mlp_down": (lambda m: m.dim, "res"),
}
#: the tags of the weight matmuls' outputs (what JAX's `dots_with_no_batch_dims_saveable` keeps)
MATMUL_TAGS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_gate", "mlp_up", "mlp_down")
#: the weight matmuls' inputs, one per group of sites reading it (q, k, v read `attn_norm`)
MATMUL_INPUTS = ("attn_norm", "attn_out", "mlp_norm", "mlp_hidden")


@dataclass(frozen=True)
class Tensor:
    name: str
    per_token: float          # elements per token (for scores: H * s)
    itemsize: int
    region: str               # res | tp | scores | moe


@dataclass(frozen=True)
class Split:
    """How the activations of one device are divided: t = tp, sp = context parallel degree,
    megatron_sp = residual stream split over tp too."""
    tp: int = 1
    sp: int = 1
    megatron_sp: bool = False

    def factor(self, region: str) -> float:
        f = 1.0 / self.sp
        if region in ("tp", "scores") or (region == "res" and self.megatron_sp):
            f /= self.tp
        return f


@dataclass(frozen=True)
class Experts:
    """A mixture of experts in `share` of the layers: E experts, k per token, `rows` expert MLP
    rows per token (`expert_rows`: capacity slots, padding included)."""
    n: int
    k: int
    rows: float
    share: float = 1.0
    width: float = 1.0        # an expert's hidden width / ffn_dim (fine-grained experts: < 1)
    shared: float = 0.0       # the shared experts' hidden width / ffn_dim


def block_tensors(model, seq_len: int, compute_itemsize: int, attention: str = "xla",
                  experts: Experts | None = None) -> list[Tensor]:
    """The per-layer saved tensors (no remat) of the table in the module docstring; with
    `experts`, averaged over the dense and MoE layers (`moe_tensors`)."""
    m, b = model, compute_itemsize
    ffn = m.ffn_dim * mlp_rows(experts)
    out = [Tensor("x", m.dim, b, "res"), Tensor("attn_norm", m.dim, b, "res"),
           Tensor("q", m.n_heads * m.hd, b, "tp"),
           Tensor("k", m.n_kv_heads * m.hd, b, "tp"), Tensor("v", m.n_kv_heads * m.hd, b, "tp")]
    if attention == "xla":
        out.append(Tensor("scores x4", 4 * m.n_heads * seq_len, 4, "scores"))
    out += [Tensor("attn_out", m.n_heads * m.hd, b, "tp"), Tensor("x_mid", m.dim, b, "res"),
            Tensor("mlp_norm", m.dim, b, "res"),
            Tensor("mlp_gate", ffn, b, "tp"), Tensor("mlp_up", ffn, b, "tp"),
            Tensor("silu chain x3", 3 * ffn, b, "tp"), Tensor("mlp_hidden", ffn, b, "tp"),
            Tensor("norm statistics", 2, 4, "res"),
            Tensor("softmax statistics", (4 if attention == "xla" else 1) * m.n_heads, 4, "tp")]
    return out + (moe_tensors(model, b, experts) if experts else [])


def mlp_rows(experts: Experts | None) -> float:
    """MLP hidden width per token, in units of a dense layer's ffn_dim, averaged over the layers
    (1 for a dense model): a MoE layer's `rows` expert rows of the expert width, and the shared
    experts' width."""
    if experts is None:
        return 1.0
    return (1 - experts.share) + experts.share * (experts.rows * experts.width + experts.shared)


def moe_tensors(model, compute_itemsize: int, e: Experts) -> list[Tensor]:
    """What a MoE layer saves besides its experts' MLP tensors (read from the forward loop of
    the compiled step, `models/moe.py`): the router's logits and probabilities (fp32) and two
    [E] masks of the top-k rounds, the scatter / gather indices (3 int32 per assignment, twice),
    the top-k weights and keep masks, the dispatched slot buffer (R rows of dim) the experts
    read, and each assignment's expert output gathered back (k rows of dim) for the weights'
    gradient. Replicated over tp (only `mlp` is split there); x `share` of the layers."""
    b, d, s = compute_itemsize, model.dim, e.share
    return [Tensor("router logits, probabilities", 2 * e.n * s, 4, "moe"),
            Tensor("router top-k masks", 2 * e.n * s, 1, "moe"),
            Tensor("slot indices", 6 * e.k * s, 4, "moe"),
            Tensor("top-k weights, keep", 2 * e.k * s, 4, "moe"),
            Tensor("expert slot buffer", e.rows * d * s, b, "moe"),
            Tensor("expert outputs per choice", e.k * d * s, b, "moe")]


@dataclass(frozen=True)
class LayerActivations:
    saved: float              # bytes per layer kept on device for the backward
    host: float               # bytes per layer offloaded to host memory
    working: float            # bytes of one layer's activations rebuilt by recompute (0: none)
    recompute_fraction: float  # fraction of the layer's forward matmul FLOPs recomputed
    tensors: dict             # name -> bytes per layer on device (for reports)


def layer_activations(model, seq_len: int, tokens: float, compute_itemsize: int, split: Split,
                      actions: dict[str, str] | None = None, attention: str = "xla",
                      experts: Experts | None = None) -> LayerActivations:
    """Bytes per layer per device for `tokens` local tokens (micro-batch x seq_len); `actions`:
    a remat policy's tag -> save | remat | offload (`jaxscale.strategies.remat.actions`; None:
    no remat, everything kept)."""
    full = {t.name: tokens * t.per_token * t.itemsize * split.factor(t.region)
            for t in block_tensors(model, seq_len, compute_itemsize, attention, experts)}
    total = sum(full.values())
    if actions is None:
        return LayerActivations(total, 0.0, 0.0, 0.0, full)
    x = full["x"]
    saved, host = {"x": x}, 0.0
    for tag, how in actions.items():
        rows = mlp_rows(experts) if tag.startswith("mlp_") and tag != "mlp_norm" else 1.0
        nbytes = tag_bytes(model, tag, tokens, compute_itemsize, split) * rows
        if how == "save":
            saved[tag] = nbytes
        elif how == "offload":
            host += nbytes
    kept = sum(saved.values())
    frac = sum(actions[t] == "remat" for t in MATMUL_TAGS) / len(MATMUL_TAGS)
    return LayerActivations(kept, host, total - kept, frac, saved)


def tag_bytes(model, tag: str, tokens: float, itemsize: int, split: Split) -> float:
    """Bytes per device of the tagged tensor (`_TAG_SIZES`) of one layer for `tokens` tokens."""
    size_fn, region = _TAG_SIZES[tag]
    return tokens * size_fn(model) * itemsize * split.factor(region)


def split(spec) -> Split:
    """How `spec` divides one device's activations: tensor parallelism splits the head and MLP
    tensors, Megatron sequence parallelism the residual stream too, context parallelism all."""
    return Split(tp=spec.deg("tp"), sp=spec.deg("sp"), megatron_sp=spec.sequence_parallel)


def stream_bytes(spec) -> float:
    """One [micro-batch, local sequence, dim] activation of the residual stream in the compute
    dtype as a collective carries it (Megatron's bsh): what a TP all-reduce or a pipeline stage
    boundary moves."""
    return spec.micro_batch * spec.local_seq * spec.model.dim * spec.wire_compute_itemsize


# ----------------------------------------------------------------------------- mixtures of experts
def grouped(spec) -> bool:
    """The grouped experts (`strategies/ep/grouped.py`): the kept assignments sorted by expert,
    exchanged over ep in bounded blocks, `jax.lax.ragged_dot` over the rows: dropless, with a
    sequence split over devices (context parallelism, Megatron SP), or with 8-bit QAT (its
    grouped matmuls). Otherwise the capacity mode's slot buffer."""
    return bool(spec.moe) and bool(spec.model.moe_dropless or tokens_split(spec)
                                   or spec.qat != "none")


def tokens_split(spec) -> tuple[str, ...]:
    """The mesh axes splitting the residual stream's sequence (the rule for `norm_seq`,
    `strategies/sp`): sp under context parallelism, then tp under Megatron SP; where a mixture
    of experts reads its tokens."""
    return (("sp",) * (spec.deg("sp") > 1)
            + ("tp",) * bool(spec.sequence_parallel and spec.deg("tp") > 1))


def bound(n_rows: int, n_ep: int, factor: float, cap_rows: int | None) -> int:
    """S, the rows of the grouped exchange a device sends each expert-parallel peer: all its
    `n_rows` assignments without ep; in capacity mode its slots on the peer's experts
    `cap_rows` (exact: no more can be kept); else ceil(factor x n_rows / n_ep), at most n_rows
    (`plan.moe_buffer`: rows past it overflow)."""
    if n_ep == 1:
        return n_rows
    if cap_rows is not None:
        return min(n_rows, cap_rows)
    return max(1, min(n_rows, math.ceil(factor * n_rows / n_ep - 1e-9)))


@dataclass(frozen=True)
class Exchange:
    """One device's grouped exchange per MoE layer and micro-batch: `tokens` its own tokens,
    `per_peer` rows S sent to each of `ep` peers, `sources` blocks of S rows its experts run
    (ep, times tp when the tokens are split over tp and gathered there), `local_experts`."""
    tokens: float
    per_peer: int
    ep: int
    sources: int
    local_experts: int

    @property
    def rows(self) -> int:
        return self.sources * self.per_peer


def exchange(spec) -> Exchange:
    m, e = spec.model, spec.deg("ep")
    over_tp = spec.deg("tp") if "tp" in tokens_split(spec) else 1
    tokens = spec.micro_batch * spec.local_seq / over_tp
    n = int(round(tokens * m.moe_top_k))
    cap = None if m.moe_dropless else int(spec.micro_batch * m.moe_capacity(spec.seq)
                                          * m.moe_experts // e)
    return Exchange(tokens, bound(n, e, spec.moe_buffer, cap), e, e * over_tp,
                    m.moe_experts // e)


def ragged_dense(spec) -> bool:
    """`grouped` on a CPU, where `ragged_dot` lowers to its reference: a dense matmul of every
    row with every local expert."""
    return grouped(spec) and spec.device_kind == "cpu"


def expert_rows(spec) -> float:
    """Expert rows per token (of micro-batch x local sequence) of a MoE layer: E C / T slots of
    the capacity buffer, or the grouped exchange's rows (padding included)."""
    m = spec.model
    if grouped(spec):
        return exchange(spec).rows / (spec.micro_batch * spec.local_seq)
    T = int(spec.local_seq)
    return m.moe_experts * m.moe_capacity(T) / T


def moe_layers(spec) -> int:
    """MoE layers a device runs, averaged over the pipeline's devices (the census's view)."""
    m = spec.model
    return m.n_moe_layers / spec.deg("pp") if spec.moe else 0


def experts(spec) -> Experts | None:
    """The mixture of experts of `spec`'s model, as the activation table needs it."""
    if not spec.moe:
        return None
    m = spec.model
    return Experts(m.moe_experts, m.moe_top_k, expert_rows(spec), m.n_moe_layers / m.n_layers,
                   m.expert_ffn / m.ffn_dim, m.moe_shared_experts * m.expert_ffn / m.ffn_dim)
