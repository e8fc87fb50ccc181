"""Megatron tensor parallelism over the `tp` mesh axis (arXiv 1909.08053).

Rules: `heads`, `kv_heads`, `mlp` and `vocab` over `tp`: Q/K/V and the MLP gate/up projections
are column-parallel, the attention output and MLP down projections row-parallel, the embedding
and LM head vocabulary-parallel (the cross-entropy reduces max/sum over `tp` without gathering
the logits). Saves: weights and the head/MLP activations split t ways; the [b, s, h] residual
stream stays replicated (Megatron sequence parallelism, `plan.sequence_parallel`, splits it).
Costs: activation collectives on the critical path. Per layer and micro-batch, with
bsh = micro-batch x sequence x dim x compute bytes: 2 all-reduces of bsh in the forward (after
the row-parallel matmuls) and, as XLA compiles jaxscale's block, 5 in the backward: the input
gradients of q, k, v, gate and up are reduced separately because the model keeps them as
separate weights (Megatron's minimum is 2, with fused QKV and gate-up weights; `Comm.minimum`).
A rematerialised forward repeats the attention-output all-reduce unless it kept `o_proj` (the
MLP-down output only feeds the residual, so XLA never recomputes it). Plus the vocabulary-
parallel embedding (forward) and head input gradient (backward), and 3 fp32 [b, s] softmax
statistics (max, sum, target logit). Sequence parallelism turns each all-reduce into a
reduce-scatter + all-gather pair of the same total bytes.
"""
from __future__ import annotations

from jaxscale.strategies import pp
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.remat import actions
from jaxscale.strategies.tables.activations import expert_rows, moe_layers, stream_bytes

NAME = "tp"
AVAILABLE = True
SHARDED = ("heads", "kv_heads", "mlp", "vocab")
#: the column-parallel sites (gather the residual stream, split the output features) and the
#: row-parallel ones (contract split features, scatter back to the residual stream)
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")
_FIELDS = ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


def active(spec) -> bool:
    return spec.deg("tp") > 1


def problems(spec) -> list[str]:
    t, errs = spec.deg("tp"), []
    for name in _FIELDS:
        v = getattr(spec.model, name)
        if v % t:
            errs.append(f"model.{name}={v} is not divisible by mesh.tp={t}: choose tp dividing it "
                        f"or change the model (tensor parallelism splits {name} over tp)")
    return errs


def rules(spec, rules) -> None:
    if active(spec):
        for name in SHARDED:
            rules.add(name, "tp", by="tp")


def collectives(spec) -> list[Comm]:
    t = spec.deg("tp")
    if t == 1:
        return []
    L, k = spec.stage_layers, max(1, spec.accumulate)
    act = stream_bytes(spec)
    redo = 1 if actions(spec.remat)["o_proj"] == "remat" else 0
    fwd, bwd = (2 + redo) * L * k, 5 * L * k
    ko = pp.outer_runs(spec)             # embedding and head: on their pipeline stage
    stats = 3 * spec.micro_batch * spec.local_seq * 4 * ko
    if spec.sequence_parallel:      # each all-reduce: a reduce-scatter to the sequence shards
        rs = dict(group=t, cpu_kind="all-reduce")
        rows = [Comm("reduce-scatter", ("tp",), (fwd + bwd) * act, int(fwd + bwd),
                     f"block outputs ({2 + redo} forward) and input gradients of q, k, v, gate, "
                     f"up (5 backward) per layer", **rs),
                Comm("all-gather", ("tp",), 6 * L * k * act, 6 * L * k,
                     "norm outputs into the attention and MLP (2 forward), their output "
                     "gradients and the norm outputs again for the weight gradients (4 backward) "
                     "per layer (a rematerialised forward's gathers take the place of the "
                     "latter)", group=t),
                Comm("all-gather", ("tp",), 2 * act * ko, 2 * ko,
                     "final norm output into the LM head, forward and backward", group=t),
                Comm("reduce-scatter", ("tp",), 2 * act * ko, 2 * ko,
                     "vocab-parallel embedding (fwd) and head input gradient (bwd)", **rs)]
        if spec.tp_overlap != "none":  # collective matmul: the block's gathers and scatters
            rows = rows[2:]             # are ring permutes, counted by overlap.collectives
    else:
        extra, moe_redo = _expert_extra(spec)      # MoE layers: their MLP's on the slot buffer
        rows = [Comm("all-reduce", ("tp",), (fwd + bwd + extra) * act,
                     int(fwd + bwd + moe_redo),
                     f"block activations: {2 + redo} forward + 5 backward per layer"
                     + (" (a MoE layer's MLP ones on its slot buffer)" if extra else ""),
                     group=t, minimum=(fwd + 2 * L * k) * act),
                Comm("all-reduce", ("tp",), 2 * act * ko, 2 * ko,
                     "vocab-parallel embedding (fwd) and head input gradient (bwd)", group=t)]
    rows.append(Comm("all-reduce", ("tp",), stats, 3 * ko,
                     "softmax max, sum and target logit over the vocabulary", group=t))
    return rows


def _expert_extra(spec) -> tuple[float, int]:
    """A MoE layer's MLP all-reduces act on its slot buffer, R = `expert_rows` rows per
    token, not on bsh: the expert outputs forward, the gate and up input gradients backward
    (and the outputs again when remat replays the experts). Returns (the bytes beyond the dense
    count, in bsh units, and the extra all-reduces of a replay)."""
    if not spec.moe:
        return 0.0, 0
    k, Lm, r = max(1, spec.accumulate), moe_layers(spec), expert_rows(spec)
    redo = 1 if actions(spec.remat)["mlp_down"] == "remat" else 0
    return (3 * (r - 1) + redo * r) * Lm * k, redo * Lm * k


def memory(spec) -> list[Term]:
    """The buffers of the backward's q/k/v input-gradient all-reduces (3 bsh)."""
    if not active(spec):
        return []
    bsh = stream_bytes(spec) / (spec.deg("tp") if spec.sequence_parallel else 1)
    return [Term("backward", 3 * bsh, "q/k/v input-gradient all-reduce buffers")]


def label(spec) -> list[str]:
    return []
