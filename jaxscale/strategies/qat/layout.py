"""Where int8 QAT's weights are quantised relative to fsdp's gathers, and what the gathers and
the scales' reductions move (`jaxscale.strategies.qat`'s collectives, `fsdp`'s formula).

Under GSPMD each device quantises its own shard of a block weight (`on_shards`: the int8 values
and the per-channel scales constrained to the weight's layout, ZeRO-3's dp included), so fsdp's
forward gathers move int8 values and the scales the devices do not hold; a weight that reaches
the projection already gathered (`arrives_gathered`) is quantised there. `weight_gathers` is
the formula of each weight's gathers (also under collective matmul's rings), row by row with
the census.
"""
from __future__ import annotations

import math
from typing import NamedTuple

QUANTISED_SITES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def active(spec) -> bool:
    return spec.qat != "none"


def _quantised(spec) -> list:
    """The block weights this strategy quantises (`QUANTISED_SITES`), as parameter leaves."""
    from jaxscale.strategies.tables.params import leaves
    return [leaf for leaf in leaves(spec.model) if leaf.path.split("/")[-1] in QUANTISED_SITES]


def _contracted(leaf, contracted: bool) -> list[int]:
    """A weight's contracted dimensions (its input: `tables.params.contracted_axes`), or the
    others (its channels, those of its per-channel scales; the layers axis left out)."""
    from jaxscale.strategies.tables.params import STACKED, contracted_axes
    into = contracted_axes(leaf.axes)
    return [d for d, ax in enumerate(leaf.axes)
            if ax not in STACKED and (d in into) == contracted]


def _channels(spec, leaf, drop=()) -> float:
    """Local elements of a weight's per-channel scales, over all its layers."""
    shape = leaf.local_shape(spec, drop)
    return float(math.prod(shape[d] for d, ax in enumerate(leaf.axes)
                           if d not in _contracted(leaf, True)))


def _split_by(spec, leaf, contracted: bool, mesh_axis: str) -> bool:
    """Whether `mesh_axis` splits the weight's contracted (or channel) dimensions."""
    return any(mesh_axis in spec.rules.table.get(leaf.axes[d], ())
               for d in _contracted(leaf, contracted))


class Gathers(NamedTuple):
    """fsdp's all-gathers of one quantised block weight over the layers a device runs."""
    forward: float            # bytes
    backward: float           # bytes, a remat policy's replayed forward included
    forward_count: int        # gathers per layer
    backward_count: int
    backward_minimum: float   # the least the backward could move (no replay regathers)


def weight_gathers(spec, leaf) -> Gathers | None:
    """fsdp's all-gathers of a quantised block weight, or None where they are the compute
    dtype's (`fsdp.collectives`): any other leaf or plan, the experts' weights (the grouped
    seam), and the column weights gathered before tensor parallelism's region under a remat
    policy (`arrives_gathered`).

    - collective matmul on QAT's operands (`overlap.quantised`): the ring's region gathers the
      weight quantised: forward 1 byte per element (int8 with its per-channel fp32 scales where
      fsdp splits a channel dimension); backward fp8's e4m3 again, int8's straight-through
      backward the compute dtype;
    - int8 under GSPMD: each device quantises its own shard (`on_shards`), so the forward gathers
      the int8 values (1 byte per element) and, where fsdp splits a channel dimension (wo's and
      w_down's `embed`), the fp32 scales, a second gather; the straight-through backward gathers
      the weight in the compute dtype. Under a remat policy the replayed forward gathers again
      for each matmul whose output it recomputes (not w_down's, which only feeds the residual):
      the int8 values and scales where the policy recomputes the matmul, the scales alone under
      `save_dots`, which keeps the int32 product and replays its rescaling. The least any program
      moves for this method is the forward's int8 values and scales and the backward's
      unquantised weight (`backward_minimum`: a replay could quantise the backward's copy);
    - fp8 under GSPMD: each device casts its own shard to e4m3 (per-tensor divisor, a scalar),
      and the forward and the backward (which keeps the e4m3 weight) gather e4m3
      (`e4m3_wire_itemsize`), a replayed forward once more."""
    site = leaf.path.split("/")[-1]
    if not active(spec) or site not in QUANTISED_SITES:
        return None
    elements = leaf.run_size(spec, drop=("fsdp",))
    split = bool(_gathered_over(spec, leaf, False))
    scales = 4 * _channels(spec, leaf, ("fsdp",)) * elements / leaf.local_size(
        spec, drop=("fsdp",)) if split else 0.0
    plain = elements * spec.wire_param_itemsize
    if spec.tp_overlap != "none":
        if spec.qat == "fp8":
            return Gathers(elements, elements, 1, 1, elements)
        return Gathers(elements + scales, plain, 1, 1, plain)
    if not _on_shards(spec, leaf):
        return None
    if spec.qat == "fp8":
        e4m3 = elements * e4m3_wire_itemsize(spec)
        again = e4m3 if _replayed(spec, site) else 0.0
        return Gathers(e4m3, e4m3 + again, 1, 1 + int(bool(again)), e4m3)
    n = 1 + int(split)
    again, count = 0.0, 0
    if _replayed(spec, site):
        again, count = elements + scales, n
    elif _saves_products(spec) and split and site != "w_down":
        again, count = scales, 1
    return Gathers(elements + scales, plain + again, n, 1 + count, plain)


def e4m3_wire_itemsize(spec) -> int:
    """Bytes of an e4m3 element in a collective: 1, but 2 on XLA:CPU, which carries float8 in
    f16 (4 where the census counts f16 as the formulas' widened 16-bit values:
    `precision.cpu_widened`)."""
    from jaxscale.strategies import precision
    if spec.hardware.native_16bit:
        return 1
    return 4 if "f16" in precision.cpu_widened(spec) else 2


def layer_entries(entries, shape, sizes: dict, zero3: bool, layers: int | None) -> list:
    """The mesh entries of one layer's slice of a weight (`entries`, `shape`: its dimensions but
    `layers`): the rules', and under ZeRO-3 dp where `zero.shard_entries` puts it on the stored
    weight ([layers, ...] when stacked), unless that is the layers dimension (each layer then
    lives whole on a dp rank)."""
    from jaxscale.strategies.zero import shard_entries
    entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else (e or None) for e in entries]
    if not zero3:
        return entries
    lead = [None] if layers else []
    return shard_entries(lead + entries, tuple(lead and [layers]) + tuple(shape), sizes, 3,
                         "dp")[len(lead):]


def _layer_entries(spec, leaf) -> list:
    from jaxscale.axes import MESH_AXES
    dims = [d for d, ax in enumerate(leaf.axes) if ax != "layers"]
    return layer_entries([spec.rules.table.get(leaf.axes[d]) for d in dims],
                         [leaf.shape[d] for d in dims], {a: spec.deg(a) for a in MESH_AXES},
                         spec.zero >= 3 and spec.deg("dp") > 1,
                         leaf.shape[0] if leaf.stacked else None)


def _gathered_over(spec, leaf, contracted: bool) -> tuple[str, ...]:
    """The data axes a weight is gathered over (fsdp; dp under ZeRO-3) that split one layer's
    contracted dimensions (or its channels)."""
    from jaxscale.axes import entry_axes
    from jaxscale.strategies.zero import gather_axes
    dims = [d for d, ax in enumerate(leaf.axes) if ax != "layers"]
    mine = _contracted(leaf, contracted)
    split = {a for d, e in zip(dims, _layer_entries(spec, leaf)) if d in mine
             for a in entry_axes(e)}
    return tuple(a for a in gather_axes(spec) if a in split)


def _local_channels(spec, leaf, whole=()) -> float:
    """One device's channels of a weight's per-channel scales (split as its shard is,
    `_layer_entries`, but for the axes `whole`, gathered before it is quantised), over the
    layers it runs."""
    from jaxscale.axes import entry_axes
    dims = [d for d, ax in enumerate(leaf.axes) if ax != "layers"]
    channels = _contracted(leaf, False) + [d for d in dims if leaf.axes[d] == "experts"]
    return spec.layers_per_device * float(math.prod(
        leaf.shape[d] // math.prod(spec.deg(a) for a in entry_axes(e) if a not in whole)
        for d, e in zip(dims, _layer_entries(spec, leaf)) if d in channels))


def _saves_products(spec) -> bool:
    """Whether the remat policy keeps the matmuls' raw products (`save_dots`: int8's int32
    dot, whose rescaling the replay then repeats)."""
    from jaxscale.strategies.remat import parse
    return parse(spec.remat) == "save_dots"


def _on_shards(spec, leaf) -> bool:
    """Whether 8-bit QAT quantises the weight on its shards (`on_shards`) under GSPMD, and these are
    split over the gather axes (else fsdp's gather, if any, is of whole layers, in the compute
    dtype; under ZeRO++ its gather seam's, in its own format: the weight arrives whole,
    `arrives_gathered`)."""
    from jaxscale.strategies import zeropp
    from jaxscale.strategies.zero import gather_axes
    split = set(_gathered_over(spec, leaf, True) + _gathered_over(spec, leaf, False))
    return (spec.qat in ("int8", "fp8") and spec.tp_overlap == "none"
            and "experts" not in leaf.axes and not zeropp.active(spec)
            and split == set(gather_axes(spec))
            and not (spec.remat not in ("none", "") and leaf.path.split("/")[-1]
                     in _columns(spec)))


def _replayed(spec, site: str) -> bool:
    """Whether a remat policy's replayed forward recomputes the site's matmul."""
    from jaxscale.strategies.remat import replays
    return site != "w_down" and replays(spec.remat, (site,))


def _columns(spec) -> tuple[str, ...]:
    """The sites tensor parallelism runs in its column groups' region (none without tp)."""
    from jaxscale.strategies.tp import COLUMN
    return COLUMN if spec.deg("tp") > 1 else ()


def arrives_gathered(site: str, rules) -> bool:
    """Whether a block weight reaches the projection already gathered over the data axes: by
    ZeRO++'s `gather` seam (in its own format), or, under a remat policy, before the column
    group's region (`remat.gathered_before`: one copy in the compute dtype for the replay and
    the backward)."""
    from jaxscale.hooks import implementation
    from jaxscale.strategies import remat
    from jaxscale.strategies.tp import COLUMN
    if implementation("gather") is not None:
        return True
    return (remat.replayed() and site in COLUMN
            and rules.seams.get("columns") == "tp_columns")


def on_shards(eq: str, w_q, site: str, w_names, rules):
    """The 8-bit weight and its scales laid out as the weight is (int8's per-channel scales'
    contracted dimensions, of size 1, whole; fp8's per-tensor divisor and amax are scalars):
    each device quantises its own shard, and FSDP's gather moves the 8-bit values (and int8's
    fp32 scales), never the unquantised weight (`weight_gathers`).
    The weight's layout: the rules' (the region's, inside one), split over dp too under ZeRO-3
    where dp is not manual here."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxscale.axes import active, entry_axes
    from jaxscale.strategies.qat import numerics
    here = active()
    if here is None:
        return w_q
    mesh = here[0]
    qw, *rest = w_q
    manual = {a for a, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ()))
              if t == jax.sharding.AxisType.Manual}
    opt = rules.options.get("projection", {})
    entries = layer_entries(list(here[1].spec(w_names)) + [None] * (qw.ndim - len(
        here[1].spec(w_names))), qw.shape, dict(opt.get("sizes", ())),
        bool(opt.get("zero3")) and "dp" not in manual, opt.get("layers"))
    spec = P(*(None if not (k := tuple(a for a in entry_axes(e) if a not in manual))
               else k[0] if len(k) == 1 else k for e in entries))
    _, cw, _ = numerics._dims(eq)
    entries = tuple(spec) + (None,) * (qw.ndim - len(spec))
    channels = NamedSharding(mesh, P(*(None if d in cw else e for d, e in enumerate(entries))))
    return (jax.lax.with_sharding_constraint(qw, NamedSharding(mesh, P(*entries))),
            *(jax.lax.with_sharding_constraint(t, channels) if t.ndim else t for t in rest))


def int8_scale_collectives(spec) -> list:
    """int8's reductions of scales (`jaxscale.strategies.qat.collectives`)."""
    from jaxscale.strategies.common import Comm
    from jaxscale.strategies.tables.activations import exchange
    L, t, out = spec.model.n_layers, spec.deg("tp"), []
    weights = _quantised(spec)
    if t > 1:
        k, runs = max(1, spec.accumulate), spec.layers_per_device
        again = int(_replayed(spec, "wo"))          # a replayed forward re-quantises wo's input
        rescaled = int(not again and spec.remat not in ("none", "")
                       and _saves_products(spec))   # or rescales its kept int32 product
        tokens = spec.local_batch * spec.local_seq
        down = runs * tokens
        if spec.moe:        # a MoE layer's w_down reads the grouped experts' rows (ep/grouped.py)
            Lm = spec.model.n_moe_layers
            down += Lm * (exchange(spec).rows * k - tokens)
        rows = [leaf for leaf in weights if _split_by(spec, leaf, True, "tp")]   # wo, w_down
        wo = [leaf for leaf in rows if leaf.path.endswith("wo")]
        # collective matmul's region takes its weights gathered over ZeRO-3's dp
        whole = ("dp",) if spec.tp_overlap != "none" else ()
        out += [Comm("all-reduce", ("tp",), 4 * (tokens * runs * (1 + again + rescaled) + down),
                     int((2 + again + rescaled) * runs * k),
                     "int8 QAT: per-token scales of wo and w_down inputs (max)", group=t),
                Comm("all-reduce", ("tp",), 4 * k * (
                    sum(_local_channels(spec, x, whole) for x in rows)
                    + (again + rescaled) * sum(_local_channels(spec, x, whole) for x in wo)),
                     int((2 + again + rescaled) * runs * k),
                     "int8 QAT: per-channel scales of wo and w_down (max)", group=t)]
    if spec.tp_overlap != "none":
        # the weights quantised before the ring's region gathers them
        split = [leaf for leaf in weights if _split_by(spec, leaf, True, "fsdp")]
        if split and spec.deg("fsdp") > 1:
            out.append(Comm("all-reduce", ("fsdp",), 4 * sum(_channels(spec, x) for x in split),
                            L, "int8 QAT: per-channel scales of weights whose contraction fsdp "
                            "splits (max), before the ring's gather", group=spec.deg("fsdp")))
        return out
    k = max(1, spec.accumulate)
    by_axes: dict = {}
    for leaf in weights:
        axes = _gathered_over(spec, leaf, True)
        if axes and _on_shards(spec, leaf):
            site = leaf.path.split("/")[-1]     # a replay quantises it again, or rescales
            runs = k * (1 + int(_replayed(spec, site) or (                  # its product
                _saves_products(spec) and site != "w_down")))
            size = 4 * _channels(spec, leaf) * leaf.run_size(spec) / leaf.local_size(spec)
            got = by_axes.setdefault(axes, [0.0, 0])
            got[0] += size * runs
            got[1] = max(got[1], runs)
    for axes, (size, runs) in by_axes.items():
        out.append(Comm("all-reduce", axes, size, int(runs * spec.layers_per_device),
                        "int8 QAT: per-channel scales of weights whose contraction the gather "
                        "axes split (max), each device quantising its shard before the gather",
                        group=math.prod(spec.deg(a) for a in axes)))
    return out
