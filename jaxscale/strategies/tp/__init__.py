"""Megatron tensor parallelism over the `tp` mesh axis (arXiv 1909.08053).

Rules: `heads`, `kv_heads`, `mlp` and `vocab` over `tp`: Q/K/V and the MLP gate/up projections
are column-parallel, the attention output and MLP down projections row-parallel, the embedding
and LM head vocabulary-parallel (the cross-entropy reduces max/sum over `tp` without gathering
the logits). Saves: weights and the head/MLP activations split t ways; the [b, s, h] residual
stream stays replicated (Megatron sequence parallelism, `plan.sequence_parallel`, splits it).
Costs: activation collectives on the critical path. Per layer and micro-batch, with
bsh = micro-batch x sequence x dim x compute bytes: 2 all-reduces of bsh in the forward (after
the row-parallel matmuls) and 2 in the backward, Megatron's minimum: the column-parallel
matmuls that read one input (q, k, v; gate, up) run as a group in one region manual over tp
(`columns.py`, the model's `columns` seam), whose backward sums their input gradients before
its one reduction; GSPMD alone reduces each of the 5 separately, as the model keeps separate
weights. A rematerialised forward repeats the attention-output all-reduce unless it kept
`o_proj` (the MLP-down output only feeds the residual, so XLA never recomputes it). Plus the
vocabulary-parallel embedding (forward) and head input gradient (backward), and 3 fp32 [b, s]
softmax statistics (max, sum, target logit). Sequence parallelism turns each all-reduce into a
reduce-scatter + all-gather pair of the same total bytes (the groups' input gradients: their
region's own reduce-scatter, which XLA:CPU emits as one too). There the row-parallel matmuls
run in a region of their own and the head's input is gathered once (`rows.py`, the model's
`stream` seam): one all-gather of a row's output gradient for both of its backward matmuls,
where GSPMD gathered it twice inside manual regions. A split pipeline schedule's W pass (ZB-H1,
ZB-V) gathers the row output gradients again from its tape, which keeps them split: 2 more
all-gathers per layer and micro-batch than the minimum (`_w_regathers`).
"""
from __future__ import annotations

import math

from jaxscale.hooks import register
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.remat import actions, parse
from jaxscale.strategies.remat import active as remat_active
from jaxscale.strategies.tables.activations import (
    exchange,
    expert_rows,
    moe_layers,
    stream_bytes,
    tokens_split,
)
from jaxscale.strategies.tables.activations import grouped as grouped_experts
from jaxscale.strategies.tables.params import outer_runs

NAME = "tp"
AVAILABLE = True
SHARDED = ("heads", "kv_heads", "mlp", "vocab")
#: the column-parallel sites (gather the residual stream, split the output features) and the
#: row-parallel ones (contract split features, scatter back to the residual stream)
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up", "shared_gate", "shared_up")
ROW = ("wo", "w_down", "shared_down")
_FIELDS = ("n_heads", "n_kv_heads", "ffn_dim")        # the vocabulary is padded (`plan.Spec`)


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
        if spec.tp_overlap == "none":       # collective matmul runs the column sites itself
            rules.set_seam("columns", "tp_columns", by="tp")
        if spec.sequence_parallel:          # the stream gathered once per use (`rows.py`)
            rules.set_seam("stream", "tp_stream", by="tp", rows=spec.tp_overlap == "none",
                           region=_row_region(spec))


@register("columns", "tp_columns")
def _columns(eq, x, ws, sites, names, mesh, rules):
    from jaxscale.strategies.tp.columns import columns
    return columns(eq, x, ws, sites, names, mesh, rules)


@register("stream", "tp_stream")
def _stream(eq, x, w, site, names, mesh, rules, inner):
    from jaxscale.strategies.tp.rows import stream
    return stream(eq, x, w, site, names, mesh, rules, inner, **rules.options.get("stream", {}))


def collectives(spec) -> list[Comm]:
    t = spec.deg("tp")
    if t == 1:
        return []
    L, k = spec.layers_per_device, max(1, spec.accumulate)
    act = stream_bytes(spec)
    redo = 1 if actions(spec.remat)["o_proj"] == "remat" else 0
    grouped = spec.tp_overlap == "none"      # the column groups (`columns.py`); else the rings
    fwd, bwd = (2 + redo) * L * k, (2 if grouped else 5) * L * k
    ko = outer_runs(spec)             # embedding and head: on their pipeline stage
    stats = 3 * spec.micro_batch * spec.local_seq * 4 * ko
    extra, moe_count = _expert_extra(spec)     # MoE layers: their MLP's on the slot buffer
    if spec.sequence_parallel:      # each all-reduce: a reduce-scatter to the sequence shards
        # a grouped MoE layer's experts read the tokens split (`strategies/ep/grouped.py`):
        # its MLP has none of the dense MLP's gathers and scatters, but the region's own
        g = moe_layers(spec) * k if grouped_experts(spec) and not _shared_experts(spec) else 0
        fwd, bwd = fwd - g, bwd - g
        rs = dict(group=t, cpu_kind="all-reduce")
        again = _w_regathers(spec)
        gspmd_rows = not _row_region(spec)       # `rows.py`: GSPMD's einsum
        block = [Comm("reduce-scatter", ("tp",), fwd * act, int(fwd),
                      f"block outputs, {2 + redo} forward per layer"
                      + ("" if gspmd_rows else " (the row matmuls' region's own reduce-scatter, "
                         "`rows.py`)"), **(rs if gspmd_rows else dict(group=t))),
                 Comm("reduce-scatter", ("tp",), (bwd + extra) * act, int(bwd + moe_count),
                      "input gradients of the q, k, v and the gate, up groups, one each per "
                      "layer in the backward (their region's own reduce-scatter)"
                      + (" (a MoE layer's gate and up ones on its slot buffer)" if extra else ""),
                      group=t),
                 Comm("all-gather", ("tp",), (6 * L * k - 3 * g + again) * act,
                      int(6 * L * k - 3 * g + again),
                      "norm outputs into the attention and MLP (2 forward), their output "
                      "gradients and the norm outputs again for the weight gradients (4 backward) "
                      "per layer (a rematerialised forward's gathers take the place of the "
                      "latter)" + ("; a split schedule's W gathers the o and down output "
                                   "gradients again: its tape keeps them split (1/t)"
                                   if again else ""),
                      group=t, minimum=(6 * L * k - 3 * g) * act)]
        rows = block if spec.tp_overlap == "none" else [    # collective matmul: ring permutes,
            Comm("all-gather", ("tp",), again * act, int(again),  # but W's regathers are GSPMD's
                 "a split schedule's W gathers the o and down output gradients from its tape, "
                 "which keeps them split (1/t); the rings gathered them in B", group=t,
                 minimum=0.0)] if again else []
        rows += _grouped_rows(spec)
        # fp32 scale gradients: each layer's two, the final norm's on the head's stage
        norms = (2 * L * k + ko) * spec.model.dim * 4
        seq = ("sp", "tp") if spec.deg("sp") > 1 else ("tp",)    # the residual's split
        rows += [Comm("all-reduce", seq, norms, int(2 * L * k + ko),
                      "RMSNorm scale gradients: each rank's norms saw a sequence shard",
                      group=t * spec.deg("sp")),
                 Comm("all-gather", ("tp",), 2 * act * ko, 2 * ko,
                      "the final norm output into the LM head (forward; its weight gradient "
                      "reads it again, `rows.py`) and the embedding output's gradient "
                      "(backward)", group=t),
                 Comm("reduce-scatter", ("tp",), 2 * act * ko, 2 * ko,
                      "vocab-parallel embedding (fwd) and head input gradient (bwd)", **rs)]
    else:
        rows = [Comm("all-reduce", ("tp",), (fwd + bwd + extra) * act,
                     int(fwd + bwd + moe_count),
                     f"block activations: {2 + redo} forward per layer, and the input "
                     f"gradients of the q, k, v and the gate, up groups (2 backward)"
                     + (" (a MoE layer's MLP ones on its slot buffer)" if extra else ""),
                     group=t, minimum=(fwd + 2 * L * k + extra) * act),
                Comm("all-reduce", ("tp",), 2 * act * ko, 2 * ko,
                     "vocab-parallel embedding (fwd) and head input gradient (bwd)", group=t)]
    rows.append(Comm("all-reduce", ("tp",), stats, 3 * ko,
                     "softmax max, sum and target logit over the vocabulary", group=t))
    return rows


def _row_region(spec) -> bool:
    """Whether the row-parallel matmuls run in `rows.py`'s region (not under a remat policy
    saving matmul outputs, nor 8-bit QAT: see there)."""
    return parse(spec.remat) != "save_dots" and spec.qat == "none"


def _w_regathers(spec) -> float:
    """The all-gathers a split pipeline schedule's W pass adds (ZB-H1, ZB-V; `strategies/pp`):
    the tape keeps each row-parallel matmul's output gradient as B received it, split along
    the sequence (1/t of its bytes), and W gathers it again for the weight gradient, where an
    unsplit backward reads B's one gather for both (`rows.py`). Per micro-batch: o and down
    of a dense layer; o (and a shared expert's down) of a MoE layer, whose experts run in
    their own region, not through the tape. Keeping them gathered instead would spare these
    at (t-1)/t of two [micro-batch, seq, dim] arrays per layer and tape slot. Under fp8 QAT
    (its scales read in W, not its amaxes) W's replayed forward gathers each column group's
    input too (GSPMD's gathers; collective matmul's rings are `overlap.w_rings`), one per row
    matmul's group (the attention's, the MLP's): twice as many (pp2 x fsdp2 x tp2 ZB-V,
    generated seed 1224: all-gather tp 0.81 of the compiled without them)."""
    from jaxscale.strategies.pp.schedules import SPLIT
    if spec.deg("pp") == 1 or spec.schedule not in SPLIT:
        return 0.0
    moe = moe_layers(spec)
    rows = 2 * (spec.layers_per_device - moe) + moe * (1 + _shared_experts(spec))
    inputs = spec.qat == "fp8" and spec.tp_overlap == "none"    # (collective matmul: rings)
    return rows * max(1, spec.accumulate) * (2 if inputs else 1)


def _grouped_rows(spec) -> list[Comm]:
    """A grouped MoE layer with its tokens split over tp (`strategies/ep/grouped.py`): the
    received rows all-gathered over tp before the experts and reduce-scattered after, forward
    and (their transposes) backward, with the per-expert counts gathered beside them; the
    router's gradient and its balance statistics reduced over the sequence shards."""
    if not (grouped_experts(spec) and "tp" in tokens_split(spec)):
        return []
    t, k, Lm, m = spec.deg("tp"), max(1, spec.accumulate), moe_layers(spec), spec.model
    replay = remat_active(spec)          # a MoE layer replays under any policy (`strategies.ep`)
    x = exchange(spec)
    rows = x.rows * m.dim * spec.wire_compute_itemsize
    n, runs = (2 + replay) * Lm * k, (1 + replay) * Lm * k
    seq = tokens_split(spec)
    return [Comm("all-gather", ("tp",), rows * n + x.sources * x.local_experts * 4 * runs,
                 n + runs, "grouped experts: the received rows gathered over tp before the "
                 "experts (forward, and the scatter's transpose backward), and their counts",
                 group=t),
            Comm("reduce-scatter", ("tp",), rows * n, n, "grouped experts: their partial "
                 "outputs scattered back over tp (forward, and the gather's transpose backward)",
                 group=t),
            Comm("all-reduce", seq, (m.dim + 2) * m.moe_experts * 4 * Lm * k, Lm * k,
                 "the router's gradient and its balance statistics over the sequence shards",
                 group=math.prod(spec.deg(a) for a in seq))]


def _expert_extra(spec) -> tuple[float, int]:
    """A MoE layer's MLP all-reduces act on its slot buffer, R = `expert_rows` rows per token,
    not on bsh: the expert outputs forward (R for 1), the gate and up input gradients backward
    (2 R, reduced apiece, for the dense layer's one gate-up group), and the outputs again when
    remat replays the experts. Returns (the bytes beyond a dense layer's, in bsh units, and
    the all-reduces beyond its count)."""
    if not spec.moe:
        return 0.0, 0
    k, Lm, m = max(1, spec.accumulate), moe_layers(spec), spec.model
    # shared experts: a dense MLP's forward and backward all-reduce beside the experts'
    shared = 2 * Lm * k if _shared_experts(spec) and not spec.sequence_parallel else 0
    if grouped_experts(spec):   # the dense MLP's at [b, t, D], with the top-k weights' gradient
        if spec.sequence_parallel:    # (k fp32 per token) reduced beside the input's
            return 0.0, 0
        return m.moe_top_k * 4 / (m.dim * spec.wire_compute_itemsize) * Lm * k + shared, shared
    r = expert_rows(spec)
    redo = 1 if actions(spec.remat)["mlp_down"] == "remat" else 0
    return ((r - 1) + (2 * r - 1) + redo * r) * Lm * k + shared, (1 + redo) * Lm * k + shared


def _shared_experts(spec) -> bool:
    """A mixture with shared experts: each MoE layer also runs a dense SwiGLU."""
    return bool(spec.moe and spec.model.moe_shared_experts)


def memory(spec) -> list[Term]:
    """The buffer of a column group's input-gradient reduction (bsh)."""
    if not active(spec):
        return []
    bsh = stream_bytes(spec) / (spec.deg("tp") if spec.sequence_parallel else 1)
    return [Term("backward", bsh, "a column group's input-gradient reduction buffer")]


def label(spec) -> list[str]:
    return []
