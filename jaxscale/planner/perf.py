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

Step time, per kernel class of the busiest device (each a documented rate, no per-run factor):
- weight matmuls (GEMMs) at the profile's sustained GEMM efficiency of the compute dtype's dense
  peak, the block's under `plan.qat=fp8|int8` at the 8-bit peak where the hardware has one
  (fp8: forward and both backward GEMMs; int8: the forward, its backward is straight-through in
  the compute dtype; `jaxscale.strategies.qat`); the `xla` attention's QK^T and PV are batched
  GEMMs too;
- a fused attention kernel's FLOPs at the profile's `attention_efficiency` (FlashAttention-2/3,
  cuDNN: about half the dense peak over forward and backward, against ~0.75-0.8 for a GEMM), the
  Pallas kernel at 0.3 of that (measured on the H200: 147-155 against cuDNN's 481-561 TFLOP/s at
  head_dim 128, seq 8192, ../shared/gpu/h200_attention_bench.md);
- memory-bound kernels (RMSNorm, residual adds, RoPE, SwiGLU's gating, the `xla` attention's
  softmax, the loss, the optimizer, the accumulator) at HBM bandwidth: bytes / hbm_bw, the bytes
  counted kernel by kernel in `hbm_bytes` (what each reads and writes, forward and backward).
Their times add: they are different kernels on one stream.
- collectives: alpha-beta per instance (`jaxscale.cost`: ring step counts and nccl-tests busbw
  factors), t = steps x latency + wire bytes / bus bandwidth, the inter-node bandwidth as soon
  as a group leaves a node;
- overlap (`exposed`): tensor, context and expert parallel collectives sit on the critical path
  (the next matmul needs them). Data-parallel and pipeline traffic runs on its own stream
  under the compute it can overlap (PyTorch DDP / FSDP buckets, Megatron's overlap-grad-reduce
  and overlap-param-gather, XLA's async collectives), the last bucket (1 / (L + 1) of it) and
  whatever exceeds its window exposed. The windows: per-micro-batch traffic (FSDP gathers and
  reductions, pipeline sends) the whole compute; the gradient reduction once per step (after
  accumulation: DDP's no_sync, the data region) only the last micro-batch's backward; the
  ZeRO-1/2 parameter gather after the update only the next step's first forward;
- pipeline bubble on top of the ideal time (`jaxscale.strategies.pp.bubble_fraction`: (p-1)/m
  of it for GPipe and 1F1B, (p-1)/(v m) interleaved, (p-1)/(3m) ZB-H1, i.e. (p-1)/(m+p-1) of
  the step for 1F1B);
- host offload transfers (PCIe) are not overlapped; the nvme tier's disk reads and writes
  pipeline with them (the slower of the two), the host update adds the host's AdamW, and its
  delayed form hides link and AdamW behind the next step's compute (`offload.tiers.seconds`).
MFU = model FLOPs / (step time x the dense peak of the plan's compute dtype): `hardware.mfu`, the
one definition the train loop and inspect use too (8-bit matmuls do not change the peak it is
measured against). `docs/planner.md` compares the step time with published runs.
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
from jaxscale.strategies.sp import head_padding
from jaxscale.strategies.tables.flops import layer_flops_per_token, moe_rows

#: a fused attention kernel's efficiency relative to the profile's (cuDNN / FlashAttention class)
KERNEL_EFFICIENCY = {"cudnn": 1.0, "pallas": 0.3}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_gate", "mlp_up")


def recompute_per_token(parts: dict, remat: str) -> float:
    """Forward FLOPs a remat policy replays in the backward, per token and layer.

    Replayed: the q, k, v, gate and up projections whose tags are not kept; the attention-output
    projection unless `o_proj` is kept (its output rebuilds the residual the MLP norm needs);
    QK^T always (no policy keeps the probabilities) and PV unless `attn_out` is kept. Never the
    dense MLP-down projection: its output only feeds the residual, so XLA drops its replay (a
    MoE layer's is replayed: `flops` adds it)."""
    return sum(_replay(parts, remat))


def _replay(parts: dict, remat: str) -> tuple[float, float]:
    """(weight-matmul FLOPs, attention-core FLOPs) a remat policy replays per token and layer."""
    if remat in ("none", ""):
        return 0.0, 0.0
    policy = actions(remat)
    replay = sum(parts[t] for t in PROJECTIONS if policy[t] == "remat")
    core = parts["attention"]
    return replay, (core / 2 if policy["attn_out"] in ("save", "offload") else core)


@dataclass
class Flops:
    per_device: float            # matmul FLOPs per device per step (forward + backward + remat),
                                 # averaged over the pipeline's devices (what the HLO shows)
    forward: float
    recompute: float
    model_per_device: float      # 6 Psi + attention (causal) per token, for MFU
    busiest: float = 0.0         # the busiest pipeline device's (its stages' layers, and the
                                 # head or the embedding where it holds them): the step's pace
    attention: float = 0.0       # of `busiest`: a fused attention kernel's (forward, backward,
                                 # its own and the remat policy's replays)
    eight_bit: float = 0.0       # of `busiest`: the block matmuls on 8-bit operands (plan.qat)

    def as_dict(self) -> dict:
        return asdict(self)


def flops(spec) -> Flops:
    """Matmul FLOPs per device and step. A device runs its stages' layers (`stages.py`); the
    mean over the devices is L / pp layers and the head over pp."""
    m = spec.model
    causal_kernel = spec.attention != "xla"
    parts = layer_flops_per_token(m, spec.seq, causal_kernel, *moe_rows(spec))
    parts["attention"] *= head_padding(spec)       # Ulysses' zero heads (`strategies/sp`)
    per_layer = sum(parts.values())
    head = 2 * m.dim * m.padded_vocab
    tokens = spec.batch * spec.seq / (spec.data_degree * spec.deg("sp")) / spec.deg("tp")
    rec_mm, rec_att = _replay(parts, spec.remat)
    rows, share = moe_rows(spec)
    if share and actions(spec.remat)["mlp_down"] == "remat":
        # a MoE layer's down projection (and the router's last third) is replayed too: the
        # combine's backward needs every expert output (`jaxscale.strategies.ep`)
        rec_mm += (2 * m.dim * m.expert_ffn * rows + 2 * m.dim * m.moe_experts / 3) * share
    if causal_kernel:      # a fused kernel's backward recomputes QK^T: 2.5x its forward
        rec_att += 0.5 * parts["attention"]
    rec_layer = rec_mm + rec_att
    att_layer = (3 * parts["attention"] + rec_att) if causal_kernel else 0.0
    block = per_layer - parts["attention"]
    eight = {"fp8": 3 * block + rec_mm, "int8": block + rec_mm}.get(spec.qat, 0.0)
    embed = embedding_gradient(spec, tokens * spec.deg("tp")) * spec.deg("pp")
    where, counts = stages.placement(spec), stages.device_counts_or_even(spec)
    first, last = where[0], where[-1]

    def device(d, layers):
        fwd = tokens * (per_layer * layers + head * (d == last))
        rec = tokens * rec_layer * layers
        return (fwd, rec, 3 * fwd + rec + embed * (d == first), tokens * att_layer * layers,
                tokens * eight * layers)
    p = spec.deg("pp")
    work = [device(d, n) for d, n in enumerate(counts)]
    fwd, rec, total = (sum(w[i] for w in work) / p for i in range(3))
    model_tok = m.flops_per_token(spec.seq, causal=True)      # active experts only
    busy = max(work, key=lambda w: w[2])
    return Flops(total, fwd, rec, model_tok * spec.batch * spec.seq / spec.n_devices,
                 busy[2], busy[3], busy[4])


def embedding_gradient(spec, tokens: float) -> float:
    """The embedding gradient's one-hot matmul, on the first stage, for small vocabularies
    (`jaxscale.models.layers.embed_lookup`): 2 x vocabulary / tp x dim per local token."""
    from jaxscale.models.layers import ONE_HOT_MAX_VOCAB
    m = spec.model
    if m.vocab_size > ONE_HOT_MAX_VOCAB:
        return 0.0
    return 2 * m.padded_vocab / spec.deg("tp") * m.dim * tokens / spec.deg("pp")


def hbm_bytes(spec, memory) -> float:
    """Bytes the memory-bound kernels of the busiest device read and write per step.

    Per token and layer, forward (F) and backward (B), in the compute dtype (beta), a tensor
    written once and read once per use: each RMSNorm F reads x, writes y (2 d), B reads x and dy,
    writes dx (3 d); each residual add F 3 d, its B (the gradient sum at the branch) 3 d; RoPE
    on q and k F 2 (H + K) hd, B as much; SwiGLU's gating F reads gate and up, writes the hidden
    (3 f), B reads the three, writes two gradients (5 f) (a MoE layer: per expert row of width
    f_e, plus the dispatch and combine copies of the k routed rows, 2 d each); the `xla`
    attention's softmax F reads the scores and writes the probabilities (2 H s, fp32), B reads
    probabilities and their gradient and writes the scores' (3 H s). Residual-stream kernels run
    whole on every tp rank unless Megatron sequence parallelism splits them; the rest split over
    tp. A remat policy replays the F of what it does not keep. 8-bit matmuls (`plan.qat`) cast
    their operands: each cast reads the tensor twice (its amax, then the scaled copy) and writes
    one byte per element: F the matmul inputs (two residual-stream tensors, the attention output,
    the MLP hidden), under fp8 B the output gradients of the seven matmuls, and once per
    micro-batch the block's weights (fp8: twice, the backward's transposed copy too). Per local
    token on the last stage the loss: fp32 logits read twice and their gradient written
    (3 V / tp x 4). Per step the
    optimizer reads and writes parameters, master weights and moments and reads the gradients,
    and with accumulation an fp32 accumulator is read and written per micro-batch."""
    m = spec.model
    beta = spec.compute_itemsize
    tp, d, hd = spec.deg("tp"), m.dim, m.hd
    res = d / (tp if spec.sequence_parallel else 1)
    policy = actions(spec.remat) if spec.remat not in ("none", "") else None
    rope = 2 * (m.n_heads + m.n_kv_heads) * hd / tp
    rows, share = moe_rows(spec)
    gate = 3 * (m.ffn_dim * (1 - share) + rows * m.expert_ffn * share) / tp
    route = 4 * m.moe_top_k * d * share          # dispatch + combine copies, forward
    scores = (2 * m.n_heads * spec.seq * 4 / tp / beta) if spec.attention == "xla" else 0.0
    forward = 4 * res + 6 * res + rope + gate + route + scores
    backward = 6 * res + 6 * res + rope + gate * 5 / 3 + route + scores * 3 / 2
    replay = 0.0
    if policy:
        replay += 2 * res * ((policy["attn_norm"] == "remat") + (policy["mlp_norm"] == "remat"))
        replay += rope * (policy["q_proj"] == "remat" or policy["k_proj"] == "remat")
        replay += (gate + route) * (policy["mlp_hidden"] == "remat")
        replay += scores + 3 * res * (policy["o_proj"] == "remat")
    tokens = spec.batch * spec.seq / (spec.data_degree * spec.deg("sp"))
    layers = max(stages.device_counts_or_even(spec))
    block = tokens * layers * (forward + backward + replay) * beta
    k = max(1, spec.accumulate)
    if spec.qat in ("fp8", "int8"):
        cast = 2 * beta + 1
        inputs = 2 * res + (m.n_heads * hd + m.ffn_dim) / tp
        grads = (m.n_heads + 2 * m.n_kv_heads) * hd / tp + 2 * res + 2 * m.ffn_dim / tp
        passes = 2 if spec.qat == "fp8" else 1
        block += tokens * layers * cast * (inputs + grads * (passes - 1))
        experts = m.moe_experts / spec.deg("ep") * m.expert_ffn * share
        weights = (d * hd * (2 * m.n_heads + 2 * m.n_kv_heads)
                   + 3 * d * (m.ffn_dim * (1 - share) + experts)) / tp
        block += layers * weights * cast * passes * k
    loss = tokens * 3 * m.padded_vocab / tp * 4
    state = memory.params + memory.master + memory.optimizer
    optimizer = 2 * state + memory.grads
    params = memory.params / max(1, spec.param_itemsize)        # local parameters
    accumulator = 8 * params * k if k > 1 else 0.0
    return block + loss + optimizer + accumulator


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
    attention: float = 0.0       # of `compute`: the fused attention kernel's

    def as_dict(self) -> dict:
        return asdict(self)


def collective_time(spec, c: Comm) -> float:
    """alpha-beta time of `c`'s `count` executions, on the link class its axes use."""
    hw = spec.hardware
    cross = spec.cross_node(c.axes)
    return alpha_beta(c.count * ring_steps(c.kind, c.group), c.wire_bytes, hw.latency(cross),
                      hw.collective_bw(cross))


def window(c: Comm) -> str:
    """The compute an overlappable collective can hide under: `step` for the gradient reduction
    run once per step after the last micro-batch (the data region's, `strategies/dp`), `update`
    for ZeRO-1/2's gather of the updated parameters (`strategies/zero.py`), else `all` (per
    micro-batch traffic: FSDP gathers and reductions, pipeline sends), `period` for streaming
    local SGD's delayed average: issued once every H steps as a step starts, it hides under
    that one step's compute (its per-step bytes are 1/H of one average's)."""
    if "once per step" in c.what and c.kind in ("all-reduce", "reduce-scatter"):
        return "step"
    if "updated parameters" in c.what:
        return "update"
    if "as the next step runs" in c.what:
        return "period"
    return "all"


def exposed(seconds: float, hide: float, buckets: float) -> float:
    """Traffic of `seconds` overlapping compute of `hide` seconds: the excess, and the last of
    `buckets` buckets (it has nothing left to hide under)."""
    return max(0.0, seconds - hide) + min(seconds, hide) / buckets


def step_time(spec, fl: Flops, comms: list[Comm], memory) -> StepTime:
    hw = spec.hardware
    dtype = compute_dtype(spec)
    peak = hardware.peak_flops_per_device(spec.device_kind, dtype, spec.n_devices)
    peak8 = hardware.peak_8bit(spec.device_kind, spec.qat) or peak
    eff = hw.matmul_efficiency
    gemm = fl.busiest - fl.attention
    matmul = (gemm - fl.eight_bit) / (peak * eff) + fl.eight_bit / (peak8 * eff)
    attention = fl.attention / (peak * hw.attention_efficiency
                                * KERNEL_EFFICIENCY.get(spec.attention, 1.0))
    memory_bound = hbm_bytes(spec, memory) / hw.hbm_bw
    compute = matmul + attention + memory_bound
    k = max(1, spec.accumulate)
    layers = max(stages.device_counts_or_even(spec))     # the busiest device's
    times = [(c, collective_time(spec, c)) for c in comms if not c.optional]
    critical = sum(t for c, t in times if not c.overlap)
    over = {w: sum(t for c, t in times if c.overlap and window(c) == w)
            for w in ("all", "step", "update", "period")}
    rec = fl.recompute / max(fl.per_device, 1e-30)
    backward = compute * (2 / 3 * (1 - rec) + rec) / k      # the last micro-batch's backward
    H = max(1, spec.local_steps)      # a delayed average: each one against one step
    exposed_comm = (sum(max(0.0, t * H - compute) / H for c, t in times
                        if c.overlap and window(c) == "period")
                    + exposed(over["all"], compute, layers + 1)
                    + exposed(over["step"], backward, layers + 1)
                    + exposed(over["update"], compute / (3 * k), layers + 1))
    bubble = bubble_fraction(spec) * (compute + critical)
    host = 0.0
    for what, nbytes in memory.host.items():
        host += nbytes * (2 * k if what in ("params", "activations") else 2)
    offload = host / hw.host_bw
    if tiers.driven(spec):          # nvme / host update: link, disk, host AdamW (tiers.py)
        offload = tiers.seconds(spec, compute)["exposed"]
    total = compute + critical + exposed_comm + bubble + offload
    mfu = hardware.mfu(fl.model_per_device * spec.n_devices, total, spec.device_kind, dtype,
                       spec.n_devices)
    return StepTime(compute, matmul, memory_bound, critical, sum(over.values()), exposed_comm,
                    bubble, offload, total, mfu,
                    spec.batch * spec.seq / total if total else 0.0,
                    [{"kind": c.kind, "axes": list(c.axes), "seconds": t} for c, t in times],
                    attention)
