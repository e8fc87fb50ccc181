"""Communication per device per step: every collective with its kind, mesh axes, bytes and count.

Bytes are the message size as nccl-tests and `jaxscale inspect`'s census count it (all-gather:
output, reduce-scatter: input, all-reduce: operand, all-to-all / permute: what is sent). With
b = micro-batch, s = local sequence, h = dim, beta = compute dtype bytes, L = layers of this
pipeline stage, k = micro-batches per step, Psi_x = parameter bytes gathered over axis x:

- Tensor parallelism (Megatron, arXiv 1909.08053), per layer and micro-batch: 2 all-reduces of
  bsh beta in the forward (after the row-parallel attention-out and MLP-down matmuls) and, as
  XLA compiles jaxscale's block, 5 in the backward: the input gradients of q, k, v, gate and up
  are reduced separately because the model keeps them as separate weights (a fused QKV / gate-up
  weight would make it Megatron's 2). Plus the vocabulary-parallel embedding (forward) and head
  input gradient (backward), and 3 fp32 [b, s] softmax statistics (max, sum, target logit).
  A rematerialised forward repeats the attention-output all-reduce unless it kept `o_proj` (the
  MLP-down output only feeds the residual, so XLA never recomputes it).
  Megatron sequence parallelism turns each all-reduce into a reduce-scatter + all-gather pair.
- FSDP / ZeRO-3 (arXiv 1910.02054): an all-gather of every parameter in the forward and of the
  layer parameters and final norm again in the backward (3 Psi with the gradient reduction). The
  embedding is not gathered again: its gradient is a scatter-add into the local shard. The LM
  head's backward gather is `optional`: XLA's CSE sometimes reuses the forward copy and sometimes
  does not (observed both ways on the same mesh at different batch sizes), so a comparison with
  the compiler accepts either and says which it saw. With accumulation the layer gathers repeat
  per micro-batch; the loop-invariant ones (embedding, final norm, head) are hoisted out. A
  remat policy gathers the layers' RMSNorm scales once more for the replayed forward.
- Gradient reduction, once per micro-batch (XLA reduces inside the accumulation loop): a matmul
  weight is reduce-scattered over `fsdp` at its
  fsdp-gathered size, then all-reduced over the remaining data axes at its shard size (HSDP); a
  weight whose gradient is a reduction or a scatter-add (RMSNorm scales, the embedding) is
  all-reduced over all data axes at once at its gathered size (XLA reduces, then slices).
  ZeRO over `dp` (`strategies/zero.py`): stage 1 all-reduces the gradients, updates its
  optimizer shard and all-gathers the new parameters; stage 2 reduce-scatters instead (2 Psi,
  as DP); stage 3 is FSDP over (dp, fsdp). ZeRO-2/3 nest dp inside fsdp's dimension, so their
  gradients are reduced over (dp, fsdp) as one group. One 4-byte all-reduce of the token count (the loss denominator); the other
  scalar partial sums (loss, gradient norm) travel in tuples the census counts as 0 bytes.
- XLA:CPU emits a reduce-scatter as all-reduce + slice (`cpu_kind`); GPUs emit reduce-scatter.
  XLA:CPU also moves 16-bit floats as f32 (`Hardware.native_16bit`).
- Context parallelism over `sp`: ring attention passes K/V blocks around the ring, (sp - 1)
  steps forward, twice that backward (K/V again and their gradients); DeepSpeed-Ulysses
  all-to-alls q, k, v and the output forward and backward (per-link volume 4Nh/P).
- Pipeline (`pp`): per micro-batch and virtual stage one bsh activation forward and its gradient
  backward (collective-permute). Expert parallelism (`ep`): dispatch and combine all-to-alls
  forward and backward of tokens x top_k x capacity x h.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from jaxscale.planner import params as params_lib
from jaxscale.planner.activations import parse_policy
from jaxscale.strategies.common import Collective

AXES = ("dp", "pp", "fsdp", "ep", "sp", "tp")
FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
          "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
          "collective-permute": lambda n: 1.0}


@dataclass(frozen=True)
class Comm(Collective):
    """A predicted collective (`jaxscale.strategies.common.Collective` plus planner fields)."""
    group: int = 1               # devices in each replica group
    optional: bool = False       # XLA may merge it with an identical earlier collective
    cpu_kind: str = ""           # the kind XLA:CPU emits for it, when different
    overlap: bool = False        # can hide under compute (data-parallel traffic, pipeline p2p)

    @property
    def wire_bytes(self) -> float:
        return self.bytes * FACTOR[self.kind](self.group) if self.group > 1 else 0.0

    def as_dict(self) -> dict:
        d = super().as_dict()
        d["wire_bytes"] = self.wire_bytes
        return d


def _axes(names) -> tuple[str, ...]:
    return tuple(a for a in AXES if a in set(names))


def collectives(spec) -> list[Comm]:
    out: list[Comm] = []
    out += _tensor(spec)
    out += _fsdp(spec)
    out += _gradients(spec)
    out += _context(spec)
    out += _pipeline_and_experts(spec)
    return [c for c in out if c.group > 1 and c.bytes > 0]


def _group(spec, axes) -> int:
    n = 1
    for a in axes:
        n *= spec.deg(a)
    return n


def _tensor(spec) -> list[Comm]:
    t = spec.deg("tp")
    if t == 1:
        return []
    m, k = spec.model, max(1, spec.accumulate)
    L = spec.stage_layers
    tokens = spec.micro_batch * spec.local_seq
    act = tokens * m.dim * spec.compute_itemsize
    policy = parse_policy(spec.remat)
    redo = 1 if policy["o_proj"] == "remat" else 0   # mlp_down's output is never needed again
    fwd, bwd = (2 + redo) * L * k, 5 * L * k
    stats = 3 * tokens * 4 * k
    if spec.megatron_sp:
        rows = [Comm("reduce-scatter", ("tp",), (fwd - 0) * act, int(fwd), "block outputs, forward",
                     group=t),
                Comm("all-gather", ("tp",), fwd * act, int(fwd), "block inputs, forward", group=t),
                Comm("reduce-scatter", ("tp",), bwd * act, int(bwd),
                     "input gradients of q, k, v, gate, up, backward", group=t),
                Comm("all-gather", ("tp",), 2 * L * k * act, int(2 * L * k),
                     "norm outputs for the weight gradients, backward", group=t)]
    else:
        rows = [Comm("all-reduce", ("tp",), (fwd + bwd) * act, int(fwd + bwd),
                     f"block activations: {2 + redo} forward + 5 backward per layer", group=t)]
    rows.append(Comm("all-reduce", ("tp",), 2 * act * k, 2 * k,
                     "vocab-parallel embedding (fwd) and head input gradient (bwd)", group=t))
    rows.append(Comm("all-reduce", ("tp",), stats, 3 * k,
                     "softmax max, sum and target logit over the vocabulary", group=t))
    return rows


def _gather_axes(spec) -> tuple[str, ...]:
    names = ["fsdp"] if spec.deg("fsdp") > 1 else []
    if spec.zero >= 3 and spec.deg("dp") > 1:
        names.append("dp")
    return _axes(names)


def _fsdp(spec) -> list[Comm]:
    axes = _gather_axes(spec)
    if not axes:
        return []
    k, pb, deg = max(1, spec.accumulate), spec.wire_param_itemsize, spec.degrees
    n = _group(spec, axes)
    layer_f = layer_b = outer_f = outer_b = head = 0.0
    count_f = count_b = 0
    for leaf in params_lib.leaves(spec.model, spec.moe):
        size = leaf.local_size(deg, drop=("fsdp",)) * pb
        reps = spec.stage_layers if leaf.stacked else 1   # gathers issued
        inner = leaf.path.startswith("layers/")
        count_f += int(reps)
        if inner:
            layer_f += size
            layer_b += size
            count_b += int(reps)
        elif leaf.path == "head":
            outer_f += size
            head = size
        else:
            outer_f += size
            if leaf.use != "embedding":
                outer_b += size
                count_b += 1
    # Layer weights are gathered inside the layer loop, once per micro-batch; the others
    # (embedding, final norm, head) are loop-invariant: with accumulation XLA hoists their
    # gathers out of the micro-batch loop.
    out = [Comm("all-gather", axes, layer_f * k + outer_f, count_f * k,
                "parameters, forward", group=n, overlap=True),
           Comm("all-gather", axes, layer_b * k + outer_b, count_b * k,
                "layer parameters and final norm, backward (the embedding is not regathered)",
                group=n, overlap=True)]
    if spec.remat not in ("none", ""):
        # the replayed forward gathers the RMSNorm scales again (the matmul weights gathered
        # for the backward serve the replay too)
        norms = sum(leaf.local_size(deg, drop=("fsdp",)) * pb for leaf in
                    params_lib.leaves(spec.model, spec.moe) if leaf.stacked and leaf.use == "norm")
        out.append(Comm("all-gather", axes, norms * k, 2 * spec.stage_layers * k,
                        "RMSNorm scales again for the rematerialised forward", group=n,
                        overlap=True))
    if head:
        out.append(Comm("all-gather", axes, head, 1, "LM head, backward (XLA may reuse the "
                        "forward gather)", group=n, optional=True, overlap=True))
    return out


def _gradients(spec) -> list[Comm]:
    deg, pb, k = spec.degrees, spec.wire_param_itemsize, max(1, spec.accumulate)
    data = [a for a in ("dp", "fsdp", "ep", "sp") if spec.deg(a) > 1]
    if not data:
        return []
    zero = spec.zero if spec.deg("dp") > 1 else 0
    L = spec.stage_layers
    acc: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    what: dict[tuple, list] = defaultdict(list)

    def add(kind, axes, nbytes, count, text):
        key = (kind, _axes(axes))
        acc[key][0] += nbytes
        acc[key][1] += count
        if text not in what[key]:
            what[key].append(text)

    for leaf in params_lib.leaves(spec.model, spec.moe):
        reps = (int(L) if leaf.stacked else 1) * k       # reduced once per micro-batch
        # every data axis holds partial gradients; experts are complete where they live
        replica = [a for a in data if not (a == "ep" and "experts" in leaf.axes)]
        gathered = leaf.local_size(deg, drop=("fsdp",)) * pb * k   # all layers when stacked
        if leaf.use in ("norm", "embedding", "router"):
            add("all-reduce", replica, gathered, reps,
                "gradients of norm scales and the embedding, over all data axes at once")
            continue
        rest, size = list(replica), gathered
        if zero >= 2 and "dp" in rest:
            group = [a for a in rest if a in ("dp", "fsdp")]
            add("reduce-scatter", group, size, reps, "matmul weight gradients, ZeRO-2/3 "
                "(dp nested in fsdp's dimension: one reduction group)")
            rest = [a for a in rest if a not in group]
            size /= _group(spec, group)
        elif "fsdp" in rest:
            add("reduce-scatter", ["fsdp"], size, reps, "matmul weight gradients")
            rest.remove("fsdp")
            size /= spec.deg("fsdp")
        if rest:
            add("all-reduce", rest, size, reps, "gradients over the replicas")
    out = []
    for (kind, axes), (nbytes, count) in acc.items():
        out.append(Comm(kind, axes, nbytes, count, "; ".join(what[(kind, axes)]),
                        group=_group(spec, axes),
                        cpu_kind="all-reduce" if kind == "reduce-scatter" else "", overlap=True))
    if zero in (1, 2):
        local = params_lib.shards(spec.model, deg, 0, spec.moe).params * pb
        fsdp = spec.deg("fsdp") > 1
        # ZeRO shards nest as ('dp', 'fsdp') on the fsdp dimension while fsdp-sharded values are
        # fsdp-major: XLA re-lays the shards with a permute over (dp, fsdp) (half the devices
        # swap), once at stage 2; at stage 1 the update and the non-finite select each run in
        # the ZeRO layout, so the shard moves 4 times and the parameters are gathered twice.
        gathers = 2 if (zero == 1 and fsdp) else 1
        out.append(Comm("all-gather", ("dp",), gathers * local, gathers,
                        "updated parameters, ZeRO-1/2", group=spec.deg("dp"), overlap=True))
        if fsdp:
            moves = 4 if zero == 1 else 1
            out.append(Comm("collective-permute", ("dp", "fsdp"), moves * local / spec.deg("dp"),
                            moves, "ZeRO shard re-layout between fsdp-major and ('dp', 'fsdp') "
                            "order", group=2, overlap=True))
    scalar_axes = _axes(data)
    out.append(Comm("all-reduce", scalar_axes, 4, 1, "token count (the loss denominator)",
                    group=_group(spec, scalar_axes)))
    return out


def _context(spec) -> list[Comm]:
    sp = spec.deg("sp")
    if sp == 1:
        return []
    m, k, t = spec.model, max(1, spec.accumulate), spec.deg("tp")
    L = spec.stage_layers
    tokens = spec.micro_batch * spec.local_seq
    beta = spec.compute_itemsize
    if spec.sp_mode == "ring":
        kv = 2 * tokens * m.n_kv_heads * m.hd / t * beta
        steps = 3 * (sp - 1) * L * k
        return [Comm("collective-permute", ("sp",), kv * steps, int(steps),
                     "ring attention: K/V blocks forward, K/V and dK/dV backward", group=sp)]
    qkvo = tokens * (2 * m.n_heads + 2 * m.n_kv_heads) * m.hd / t * beta
    return [Comm("all-to-all", ("sp",), 2 * qkvo * L * k, int(8 * L * k),
                 "Ulysses: q, k, v, out forward and backward", group=sp)]


def _pipeline_and_experts(spec) -> list[Comm]:
    out = []
    m, k = spec.model, max(1, spec.accumulate)
    tokens = spec.micro_batch * spec.local_seq
    act = tokens * m.dim * spec.compute_itemsize / (spec.deg("tp") if spec.megatron_sp else 1)
    p = spec.deg("pp")
    if p > 1:
        v = spec.virtual if spec.schedule == "interleaved" else 1
        out.append(Comm("collective-permute", ("pp",), 2 * k * v * act, 2 * k * v,
                        "stage boundary: activations forward, their gradients backward",
                        group=p, overlap=True))
    e = spec.deg("ep")
    if e > 1 and spec.moe is not None:
        L = spec.stage_layers
        routed = tokens * spec.moe.top_k * spec.moe.capacity * m.dim * spec.compute_itemsize
        out.append(Comm("all-to-all", ("ep",), 4 * routed * L * k, int(4 * L * k),
                        "MoE dispatch and combine, forward and backward", group=e))
    return out
