"""FLOPs per step, predicted step time and MFU on a hardware profile.

FLOPs (matmuls; 2 per multiply-add). Per token and layer, forward: 2 h (H + 2K) hd for q, k, v,
2 H hd h for the output projection, 6 h f for SwiGLU (MoE: 6 h f per expert row, the slots of
its capacity buffer padding included, plus a 2 h E router; `moe_rows`),
and the attention core QK^T and PV, 4 s H hd: the `xla` attention computes the masked half too,
a fused kernel skips it (causal: half) and its backward recomputes QK^T (2.5x its forward,
FlashAttention-2). Plus the LM head 2 h V, and for a small vocabulary the embedding gradient's
one-hot matmul 2 h V (backward only). Backward = 2 x forward. A remat
policy replays the forward matmuls whose outputs it did not keep and the backward needs
(`recompute_per_token`; `full` replays all but the MLP-down projection). Per device: the
local tokens (batch / (dp fsdp ep), sequence / sp) times the per-token FLOPs / tp, the layers
/ pp. Model FLOPs for MFU are the literature's 6 Psi + 12 L h s per token, attention halved
when causal (`ModelConfig.flops_per_token`), MoE with active parameters.

Step time (stated assumptions):
- compute = matmul FLOPs / (peak x matmul_efficiency) + HBM traffic / HBM bandwidth (matmuls and
  memory-bound elementwise work are different ops; their times add). Traffic: activations
  written in the forward and read in the backward with their gradients (3x), weights read
  three times (forward, data and weight gradients), the optimizer reads and writes the state;
- collectives: alpha-beta per instance (`jaxscale.cost`: ring step counts and nccl-tests busbw
  factors), t = steps x latency + wire bytes / bus bandwidth, the inter-node bandwidth as soon
  as a group leaves a node;
- overlap: data-parallel traffic (FSDP gathers, gradient reductions, ZeRO gathers) and
  pipeline sends hide under compute except the first gather / last reduction of a step
  (1 / (L + 1) of it) and whatever exceeds the compute time; tensor, context and expert
  parallel collectives sit on the critical path (the next matmul needs them);
- pipeline bubble on top of the ideal time (`jaxscale.strategies.pp.bubble_fraction`);
- host offload transfers (PCIe) are not overlapped.
MFU = model FLOPs / (step time x the dense peak of the plan's compute dtype): `hardware.mfu`, the
one definition the train loop and inspect use too. The result is a roofline-style bound that ranks
plans; measured MFU lands below it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from jaxscale import hardware
from jaxscale.cost import alpha_beta, ring_steps
from jaxscale.strategies.common import Comm
from jaxscale.strategies.pp import bubble_fraction
from jaxscale.strategies.precision import compute_dtype
from jaxscale.strategies.remat import actions
from jaxscale.strategies.tables.activations import expert_rows, ragged_dense


def layer_flops_per_token(model, seq_len: int, causal_kernel: bool, expert_rows: float = 0.0,
                          moe_share: float = 1.0) -> dict:
    """Forward matmul FLOPs per token of one block, by part; a mixture of experts computes
    `expert_rows` expert MLP rows per token (`tables.activations.expert_rows`: the slots of its
    capacity buffer, padding included) plus the router, in `moe_share` of the layers (the rest are
    dense)."""
    d, hd, H, K, f, E = (model.dim, model.hd, model.n_heads, model.n_kv_heads, model.ffn_dim,
                         model.moe_experts)
    attn_core = 4 * seq_len * H * hd * (0.5 if causal_kernel else 1.0)
    share = moe_share if E else 0.0
    mlp = 6 * d * f * ((1 - share) + share * (expert_rows or model.moe_top_k)) + 2 * d * E * share
    return {"q_proj": 2 * d * H * hd, "k_proj": 2 * d * K * hd, "v_proj": 2 * d * K * hd,
            "o_proj": 2 * H * hd * d, "attention": attn_core,
            "mlp_gate": mlp / 3, "mlp_up": mlp / 3, "mlp_down": mlp / 3}


def recompute_per_token(parts: dict, remat: str) -> float:
    """Forward FLOPs a remat policy replays in the backward, per token and layer.

    Replayed: the q, k, v, gate and up projections whose tags are not kept; the attention-output
    projection unless `o_proj` is kept (its output rebuilds the residual the MLP norm needs);
    QK^T always (no policy keeps the probabilities) and PV unless `attn_out` is kept. Never the
    dense MLP-down projection: its output only feeds the residual, so XLA drops its replay (a
    MoE layer's is replayed: `flops` adds it)."""
    if remat in ("none", ""):
        return 0.0
    policy = actions(remat)
    replay = sum(parts[t] for t in ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_gate", "mlp_up")
                 if policy[t] == "remat")
    core = parts["attention"]
    return replay + (core / 2 if policy["attn_out"] in ("save", "offload") else core)


@dataclass
class Flops:
    per_device: float            # matmul FLOPs per device per step (forward + backward + remat)
    forward: float
    recompute: float
    model_per_device: float      # 6 Psi + attention (causal) per token, for MFU

    def as_dict(self) -> dict:
        return asdict(self)


def flops(spec) -> Flops:
    m = spec.model
    causal_kernel = spec.attention != "xla"
    parts = layer_flops_per_token(m, spec.seq, causal_kernel, *moe_rows(spec))
    per_layer = sum(parts.values())
    head = 2 * m.dim * m.padded_vocab
    tokens = spec.batch * spec.seq / (spec.data_degree * spec.deg("sp"))
    t, p = spec.deg("tp"), spec.deg("pp")
    fwd = tokens * (per_layer * spec.stage_layers + head / p) / t
    rec = tokens * recompute_per_token(parts, spec.remat) * spec.stage_layers / t
    rows, share = moe_rows(spec)
    if share and actions(spec.remat)["mlp_down"] == "remat":
        # a MoE layer's down projection (and the router's last third) is replayed too: the
        # combine's backward needs every expert output (`jaxscale.strategies.ep`)
        down = 2 * m.dim * m.ffn_dim * rows + 2 * m.dim * m.moe_experts / 3
        rec += tokens * down * share * spec.stage_layers / t
    if p > 1 and spec.schedule == "zb-h1":
        # the W pass re-runs the stage's input-gradient chain (projections, MLP and both
        # attention matmuls) and any remat replay: JAX's vjp does not split per matmul
        rec += tokens * (per_layer + parts["attention"]) * spec.stage_layers / t + rec
    model_tok = m.flops_per_token(spec.seq, causal=True)      # active experts only
    if causal_kernel:      # a fused kernel's backward recomputes QK^T: 2.5x its forward
        rec += 0.5 * tokens * parts["attention"] * spec.stage_layers / t
    return Flops(3 * fwd + rec + embedding_gradient(spec, tokens), fwd, rec,
                 model_tok * spec.batch * spec.seq / spec.n_devices)


def moe_rows(spec) -> tuple[float, float]:
    """(expert MLP rows computed per token, fraction of MoE layers) as the compiled step does it:
    `expert_rows`, except that dropless without ep on a CPU runs `jax.lax.ragged_dot`'s
    reference lowering, a dense matmul of every row with every expert (E k rows per token)."""
    m = spec.model
    if not spec.moe:
        return 0.0, 0.0
    rows = expert_rows(spec)
    if ragged_dense(spec):
        rows *= m.moe_experts
    return rows, m.n_moe_layers / m.n_layers


def embedding_gradient(spec, tokens: float) -> float:
    """The embedding gradient's one-hot matmul, on the first stage, for small vocabularies
    (`jaxscale.models.layers.embed_lookup`): 2 x vocabulary / tp x dim per local token."""
    from jaxscale.models.layers import ONE_HOT_MAX_VOCAB
    m = spec.model
    if m.vocab_size > ONE_HOT_MAX_VOCAB:
        return 0.0
    return 2 * m.padded_vocab / spec.deg("tp") * m.dim * tokens / spec.deg("pp")


@dataclass
class StepTime:
    compute: float
    matmul: float
    memory_bound: float
    critical_comm: float         # TP / SP / EP collectives
    overlapped_comm: float       # DP / FSDP / pipeline traffic, before hiding
    exposed_comm: float
    bubble: float
    offload: float
    total: float
    mfu: float
    tokens_per_s: float
    per_collective: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def collective_time(spec, c: Comm) -> float:
    """alpha-beta time of `c`'s `count` executions, on the link class its axes use."""
    hw = spec.hardware
    cross = spec.cross_node(c.axes)
    return alpha_beta(c.count * ring_steps(c.kind, c.group), c.wire_bytes, hw.latency(cross),
                      hw.collective_bw(cross))


def step_time(spec, fl: Flops, comms: list[Comm], memory) -> StepTime:
    hw = spec.hardware
    peak = hardware.peak_flops_per_device(spec.device_kind, compute_dtype(spec), spec.n_devices)
    matmul = fl.per_device / (peak * hw.matmul_efficiency)
    k = max(1, spec.accumulate)
    state = memory.params + memory.master + memory.optimizer + memory.grads
    full_layer_acts = sum(memory.layer.values()) if memory.layer else 0.0
    traffic = (3 * full_layer_acts * spec.stage_layers * k
               + 3 * memory.params * k + 2 * state)
    memory_bound = traffic / hw.hbm_bw
    compute = matmul + memory_bound
    times = [(c, collective_time(spec, c)) for c in comms if not c.optional]
    critical = sum(t for c, t in times if not c.overlap)
    overlapped = sum(t for c, t in times if c.overlap)
    layers = spec.stage_layers
    exposed = max(0.0, overlapped - compute) + min(overlapped, compute) / (layers + 1)
    bubble = bubble_fraction(spec) * (compute + critical)
    host = 0.0
    for what, nbytes in memory.host.items():
        host += nbytes * (2 * k if what in ("params", "activations") else 2)
    offload = host / hw.host_bw
    total = compute + critical + exposed + bubble + offload
    mfu = hardware.mfu(fl.model_per_device * spec.n_devices, total, spec.device_kind,
                       compute_dtype(spec), spec.n_devices)
    return StepTime(compute, matmul, memory_bound, critical, overlapped, exposed, bubble, offload,
                    total, mfu, spec.batch * spec.seq / total if total else 0.0,
                    [{"kind": c.kind, "axes": list(c.axes), "seconds": t} for c, t in times])
