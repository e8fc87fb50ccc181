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
- host offload transfers (PCIe) are not overlapped; the nvme tier's disk reads and writes
  pipeline with them (the slower of the two), the host update adds the host's AdamW, and its
  delayed form hides link and AdamW behind the next step's compute (`offload.tiers.seconds`).
MFU = model FLOPs / (step time x the dense peak of the plan's compute dtype): `hardware.mfu`, the
one definition the train loop and inspect use too. The result is a roofline-style bound that ranks
plans; measured MFU lands below it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from jaxscale import hardware
from jaxscale.cost import alpha_beta, ring_steps
from jaxscale.strategies.common import Comm
from jaxscale.strategies.offload import tiers
from jaxscale.strategies.pp import bubble_fraction, stages
from jaxscale.strategies.precision import compute_dtype
from jaxscale.strategies.remat import actions
from jaxscale.strategies.tables.flops import layer_flops_per_token, moe_rows


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
    per_device: float            # matmul FLOPs per device per step (forward + backward + remat),
                                 # averaged over the pipeline's devices (what the HLO shows)
    forward: float
    recompute: float
    model_per_device: float      # 6 Psi + attention (causal) per token, for MFU
    busiest: float = 0.0         # the busiest pipeline device's (its stages' layers, and the
                                 # head or the embedding where it holds them): the step's pace

    def as_dict(self) -> dict:
        return asdict(self)


def flops(spec) -> Flops:
    """Matmul FLOPs per device and step. A device runs its stages' layers (`stages.py`); the
    mean over the devices is L / pp layers and the head over pp."""
    m = spec.model
    causal_kernel = spec.attention != "xla"
    parts = layer_flops_per_token(m, spec.seq, causal_kernel, *moe_rows(spec))
    per_layer = sum(parts.values())
    head = 2 * m.dim * m.padded_vocab
    tokens = spec.batch * spec.seq / (spec.data_degree * spec.deg("sp")) / spec.deg("tp")
    rec_layer = recompute_per_token(parts, spec.remat)
    rows, share = moe_rows(spec)
    if share and actions(spec.remat)["mlp_down"] == "remat":
        # a MoE layer's down projection (and the router's last third) is replayed too: the
        # combine's backward needs every expert output (`jaxscale.strategies.ep`)
        rec_layer += (2 * m.dim * m.expert_ffn * rows + 2 * m.dim * m.moe_experts / 3) * share
    if causal_kernel:      # a fused kernel's backward recomputes QK^T: 2.5x its forward
        rec_layer += 0.5 * parts["attention"]
    embed = embedding_gradient(spec, tokens * spec.deg("tp")) * spec.deg("pp")
    where, counts = stages.placement(spec), stages.device_counts_or_even(spec)
    first, last = where[0], where[-1]

    def device(d, layers):
        fwd = tokens * (per_layer * layers + head * (d == last))
        rec = tokens * rec_layer * layers
        return fwd, rec, 3 * fwd + rec + embed * (d == first)
    p = spec.deg("pp")
    work = [device(d, n) for d, n in enumerate(counts)]
    fwd, rec, total = (sum(w[i] for w in work) / p for i in range(3))
    model_tok = m.flops_per_token(spec.seq, causal=True)      # active experts only
    return Flops(total, fwd, rec, model_tok * spec.batch * spec.seq / spec.n_devices,
                 max(w[2] for w in work))


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
    matmul = fl.busiest / (peak * hw.matmul_efficiency)
    k = max(1, spec.accumulate)
    state = memory.params + memory.master + memory.optimizer + memory.grads
    full_layer_acts = sum(memory.layer.values()) if memory.layer else 0.0
    layers = max(stages.device_counts_or_even(spec))     # the busiest device's
    traffic = (3 * full_layer_acts * layers * k
               + 3 * memory.params * k + 2 * state)
    memory_bound = traffic / hw.hbm_bw
    compute = matmul + memory_bound
    times = [(c, collective_time(spec, c)) for c in comms if not c.optional]
    critical = sum(t for c, t in times if not c.overlap)
    overlapped = sum(t for c, t in times if c.overlap)
    exposed = max(0.0, overlapped - compute) + min(overlapped, compute) / (layers + 1)
    bubble = bubble_fraction(spec) * (compute + critical)
    host = 0.0
    for what, nbytes in memory.host.items():
        host += nbytes * (2 * k if what in ("params", "activations") else 2)
    offload = host / hw.host_bw
    if tiers.driven(spec):          # nvme / host update: link, disk, host AdamW (tiers.py)
        offload = tiers.seconds(spec, compute)["exposed"]
    total = compute + critical + exposed + bubble + offload
    mfu = hardware.mfu(fl.model_per_device * spec.n_devices, total, spec.device_kind,
                       compute_dtype(spec), spec.n_devices)
    return StepTime(compute, matmul, memory_bound, critical, overlapped, exposed, bubble, offload,
                    total, mfu, spec.batch * spec.seq / total if total else 0.0,
                    [{"kind": c.kind, "axes": list(c.axes), "seconds": t} for c, t in times])
