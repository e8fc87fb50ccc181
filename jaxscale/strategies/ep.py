"""Expert parallelism over the `ep` mesh axis, for a mixture-of-experts model (Mixtral style).

The model (`models/moe.py`: `model.moe_experts` E, `model.moe_top_k` k, `model.capacity_factor`)
replaces the MLP of every `model.moe_every`-th layer with E SwiGLU experts and a linear router.
Rules: `experts -> ep`; tokens stay split over `ep` as over a data axis (the batch rule includes
it). Saves: expert weights, their gradients and optimizer state split ep ways (each device holds
E / ep experts whole, or split over tp and fsdp as a dense MLP is).

Costs, in collectives per MoE layer and micro-batch (as XLA compiles the step), with the slot
buffer of a device = its tokens x R x dim x compute bytes, R = E C / T expert rows per token (C
= `ModelConfig.moe_capacity(T)`, slots per expert and sequence: R = k x capacity_factor up to
rounding; R = E for dropless under ep, whose buffer is sized for the worst case):
- 2 all-to-alls over `ep` forward (dispatch to the experts' devices, combine back) and 2
  backward (their transposes), each of the whole buffer: `Comm.bytes` = tokens x R x dim x
  beta, of which (ep - 1) / ep leaves the device (the wire factor); the minimum, tokens x k x
  dim x beta, is what a ragged all-to-all of the routed tokens alone would move;
- a full-remat policy replays the forward's two all-to-alls in the backward (6 per layer):
  the combine's backward needs each token's expert outputs, so the experts are recomputed;
- expert gradients are complete where the experts live, so they are not reduced over `ep`
  (`strategies/dp`); under tp the expert MLP's all-reduces act on the buffer, not on bsh
  (`strategies/tp`).
Dropless without ep runs per data shard (`on_data_shards`): no all-to-all, and its expert
gradients are all-reduced over the data axes inside the shard_map.

The step side: `Sharded`, the implementation of the model's `experts` seam
(`jaxscale.hooks.experts`) under a plan: the dispatch and combine inside `jax.shard_map` over the
mesh (the local scatter/gather of `models/moe.py`, one `lax.all_to_all` over `ep` when `experts`
is split); the expert MLP between them is GSPMD-sharded by the rules.
"""
from __future__ import annotations

from jaxscale.axes import suspended
from jaxscale.hooks import register
from jaxscale.strategies import remat
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.fsdp import gather_axes
from jaxscale.strategies.tables.activations import expert_rows, moe_layers, ragged_dense
from jaxscale.strategies.tables.params import leaves

NAME = "ep"
AVAILABLE = True


def active(spec) -> bool:
    return spec.deg("ep") > 1 or spec.moe


def problems(spec) -> list[str]:
    e, E, errs = spec.deg("ep"), spec.model.moe_experts, []
    if e > 1 and not E:
        return [f"mesh.ep={e} needs a mixture-of-experts model (model.moe_experts=0); set "
                f"mesh.ep=1 or model.moe_experts"]
    if E and E % e:
        errs.append(f"model.moe_experts={E} is not divisible by mesh.ep={e}: each device of the "
                    f"ep axis holds E / ep whole experts; choose ep dividing {E}")
    if E and spec.deg("sp") > 1:
        errs.append(f"model.moe_experts={E} with mesh.sp={spec.deg('sp')}: expert capacity is "
                    f"counted per whole sequence, which context parallelism splits; use "
                    f"mesh.sp=1 with a mixture of experts")
    if E and spec.sequence_parallel:
        errs.append(f"model.moe_experts={E} with plan.sequence_parallel=true: the expert "
                    f"dispatch reads whole sequences on every tp rank; use "
                    f"plan.sequence_parallel=false with a mixture of experts")
    return errs


def rules(spec, rules) -> None:
    if spec.deg("ep") > 1:
        rules.add("experts", "ep", by="ep")
    if spec.moe:
        rules.set_seam("experts", "sharded", by=NAME)


def collectives(spec) -> list[Comm]:
    e = spec.deg("ep")
    if e == 1 or not spec.moe:
        return []
    m, k, L = spec.model, max(1, spec.accumulate), moe_layers(spec)
    tokens = spec.micro_batch * spec.local_seq
    buf = tokens * expert_rows(spec) * m.dim * spec.compute_itemsize
    routed = tokens * m.moe_top_k * m.dim * spec.compute_itemsize
    per_layer = 4 + (2 if remat.actions(spec.remat)["mlp_down"] == "remat" else 0)
    n = per_layer * L * k
    return [Comm("all-to-all", ("ep",), buf * n, n,
                 f"MoE dispatch and combine, forward and backward ({per_layer} per layer)",
                 group=e, minimum=routed * n)]


def memory(spec) -> list[Term]:
    """Expert weights follow the rules and the routed activations are in the layer table
    (`tables.activations.moe_tensors`). Its own: without FSDP (whose gathered layer takes its
    place) the backward of a scanned MoE layer holds a copy of the layer's expert weights sliced
    out of the stack, the operand of the batched expert matmuls; dropless without ep on a CPU
    holds the stacked expert gradient twice (read from XLA:CPU buffer assignments: dp2 x ep4,
    ep8, dp8 dropless)."""
    if not spec.moe or not spec.model.scan_layers or gather_axes(spec):
        return []
    local = sum(leaf.local_size(spec) for leaf in leaves(spec.model) if "experts" in leaf.axes)
    out = [Term("backward", local / spec.model.n_layers * spec.wire_param_itemsize,
                "one MoE layer's expert weights, sliced out of the stack")]
    if ragged_dense(spec):
        out.append(Term("backward", local * spec.wire_param_itemsize,
                        "the expert gradient stack again: updated out of place under "
                        "ragged_dot's CPU lowering (dp8 dropless)"))
    return out


def label(spec) -> list[str]:
    return []


# ----------------------------------------------------------------------------- the step
def _one(axes: tuple):
    return axes[0] if len(axes) == 1 else axes


@register("experts", "sharded")
class Sharded:
    """The dispatch under a plan (`jaxscale.hooks.experts`): each data shard scatters its own
    tokens into its slot buffer inside `jax.shard_map` over the mesh; with `experts` split over
    mesh axes, one all-to-all over them sends each expert's slots to the device holding it (and
    the inverse one brings them back). The expert MLP between is GSPMD-sharded by the rules."""

    @staticmethod
    def to_experts(mesh, rules, scatter, x_BTD, idx_BTK, pos_BTK):
        """The global buffer [E, B, C, D]: experts over ep, rows over the other data axes."""
        import jax
        from jax import lax
        ex = rules.table.get("experts", ())
        tok, buf = rules.spec(("batch", None, None)), rules.spec(("experts", "batch", None, None))

        def body(x, idx, pos):
            with suspended():
                b = scatter(x, idx, pos)
            return lax.all_to_all(b, _one(ex), 0, 1, tiled=True) if ex else b
        return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok), out_specs=buf)(
            x_BTD, idx_BTK, pos_BTK)

    @staticmethod
    def from_experts(mesh, rules, gather, out_EBCD, idx_BTK, pos_BTK, w_BTK):
        """Each slot back on its token's device, where `gather` weights and sums: [B, T, D]."""
        import jax
        from jax import lax
        ex = rules.table.get("experts", ())
        tok, buf = rules.spec(("batch", None, None)), rules.spec(("experts", "batch", None, None))

        def body(out, idx, pos, w):
            out = lax.all_to_all(out, _one(ex), 1, 0, tiled=True) if ex else out
            with suspended():
                return gather(out, idx, pos, w)
        return jax.shard_map(body, mesh=mesh, in_specs=(buf, tok, tok, tok), out_specs=tok)(
            out_EBCD, idx_BTK, pos_BTK, w_BTK)

    @staticmethod
    def on_data_shards(mesh, rules, fn, x_BTD, idx_BTK, w_BTK, w_gate, w_up, w_down):
        """Dropless without expert parallelism: `fn` on each data shard, the expert weights
        whole but for `mlp` over tp (its partial sums all-reduced over tp after the combine).
        The weights' gradients are all-reduced over the data axes inside."""
        import jax
        from jax import lax
        from jax.sharding import PartitionSpec as P
        tok, mlp = rules.spec(("batch", None, None)), rules.table.get("mlp", ())
        col = P(None, None, _one(mlp) if mlp else None)
        row = P(None, _one(mlp) if mlp else None, None)

        def body(x, idx, w, wg, wu, wd):
            if mlp:       # the input's gradient is then summed over tp once, at [b, T, D]
                x = lax.pcast(x, mlp, to="varying")
            with suspended():
                y = fn(x, idx, w, wg, wu, wd)
            return lax.psum(y, mlp) if mlp else y
        return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, col, col, row),
                             out_specs=tok)(x_BTD, idx_BTK, w_BTK, w_gate, w_up, w_down)
