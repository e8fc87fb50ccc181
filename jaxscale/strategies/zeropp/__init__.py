"""ZeRO++ (arXiv 2306.10209) on ZeRO-3 / FSDP: three parts, each its own `plan.zeropp` option
(joined with '+'), on the weight matmuls' gathers and gradient reduction (`gathers.py`).

- **qwZ** (`qwz`): each weight's all-gathers (forward and the backward's regather) carry int8
  blocks of `plan.zeropp_block` elements with one fp32 scale each, dequantised after the gather.
  Saves: about half of bf16's gather bytes (3/4 of fp32's), plus 4/block per element of scales.
  Costs: the weights the matmuls see are rounded to 8 bits (the gradient passes straight through).
- **hpZ** (`hpz`): the forward gathers over the cross-node gather axes first and keeps that
  result, a secondary copy of the parameters partitioned inside the node, for the backward, whose
  regather then runs over the node-local axes only. Saves: every backward gather's cross-node
  traffic. Costs: the secondary copy, parameters / (node-local gather devices) per device, held
  from each layer's forward to its backward (an activations term; 1 byte per element with qwZ).
- **qgZ** (`qgz`): the weights' gradient reduce-scatter as quantised all-to-alls
  (`plan.qgz_bits` 4 or 8, blocks of `plan.zeropp_block`), in a region manual over the gather
  axes: node-local axes first, then across nodes, each stage dequantising, summing in fp32 and
  quantising its partial sum again. Saves: 1/8 (int4) or 1/4 (int8) of the fp32 reduction's
  bytes, and the cross-node stage moves 1/(node-local devices) of the gradient. Costs: two
  roundings per stage.

`plan.fp8_param_gather` (under `plan.qat=fp8`, as Megatron's `--fp8-param-gather`): the gathers
carry e4m3 blocks with their scales instead, about half of bf16's bytes.

Blocks: along each shard's last dimension (a row), as many blocks of at most `plan.zeropp_block`
as the row needs, of equal size (even for int4's pairs), the row zero-padded to whole blocks
(`common.block_size`, `padded_row`): any shape and vocabulary quantises (the LM head's rows of
509 travel as 510 in int8, 512 in int4; of 255 per tp2 shard, 256 in int4), the padding on the
wire and in the formulas, under one element per block (two in int4); where the row has a divisor
not above the block that gives as few blocks, that divisor, with no padding.

Collectives per weight matmul and layer (E elements gathered, n_l node-local and n_c cross-node
gather devices): forward all-gathers of the payload (and the scales) over the gather axes (hpZ:
over the cross-node axes at E/n_l, then the node-local ones at E); backward the same again (hpZ:
only the node-local one); qgZ: per gather axis, all-to-alls of payload and scales at the
elements left (E, then E/n_l). The embedding, the norm scales and a mixture's routed experts
keep FSDP's gathers and XLA's reduction (`fsdp.py`, `dp`, `ep/`).
"""
from __future__ import annotations

import math

from jaxscale.hooks import register
from jaxscale.strategies.common import Comm, Term, block_size, parse_parts, problems_of
from jaxscale.strategies.tables.params import leaves, outer_gathers, outer_runs
from jaxscale.strategies.zero import gather_axes

NAME = "zeropp"
AVAILABLE = True
PARTS = ("qwz", "hpz", "qgz")


def parse(value: str) -> frozenset[str]:
    """The parts of `plan.zeropp` ("none", "all", or parts joined with '+')."""
    return parse_parts(value, PARTS, "plan.zeropp", "qwz+hpz", every=True)


def weights_format(spec) -> str:
    """How the weights travel: int8 (qwZ), fp8 (the fp8 parameter gather), or as stored."""
    if spec.fp8_param_gather:
        return "fp8"
    return "int8" if "qwz" in parse(spec.zeropp) else "none"


def grads_format(spec) -> str:
    return f"int{spec.qgz_bits}" if "qgz" in parse(spec.zeropp) else "none"


def cross_axes(spec) -> tuple[str, ...]:
    """The gather axes wholly across nodes (hpZ's secondary partition is whole over them)."""
    return tuple(a for a in gather_axes(spec) if spec.dcn.get(a, 1) == spec.deg(a) > 1)


def active(spec) -> bool:
    return not problems_of(parse, spec.zeropp) and (bool(parse(spec.zeropp))
                                                    or bool(spec.fp8_param_gather))


def problems(spec) -> list[str]:
    errs = problems_of(parse, spec.zeropp)
    if errs or not active(spec):
        return errs
    parts, axes = parse(spec.zeropp), gather_axes(spec)
    if spec.qgz_bits not in (4, 8):
        errs.append(f"plan.qgz_bits={spec.qgz_bits}: qgZ quantises gradients to 4 or 8 bits")
    if spec.fp8_param_gather and spec.qat != "fp8":
        errs.append(f"plan.fp8_param_gather gathers the weights in e4m3 for fp8 training, but "
                    f"plan.qat={spec.qat}: set plan.qat=fp8, or use plan.zeropp=qwz (int8)")
    if spec.fp8_param_gather and "qwz" in parts:
        errs.append("plan.fp8_param_gather and plan.zeropp=qwz both choose the gathers' format "
                    "(e4m3 or int8): choose one")
    if not axes:
        what = "plan.zeropp" if parts else "plan.fp8_param_gather"
        return errs + [f"{what} changes the gathers and gradient reduction of sharded weights, "
                       f"but this plan shards no weight over a data axis: give devices to "
                       f"mesh.fsdp (ZeRO-3), optionally with plan.zero=3 over mesh.dp"]
    if spec.deg("fsdp") == 1:
        errs.append(f"{spec.zeropp} gathers on FSDP's dimension, but mesh.fsdp=1: ZeRO-3 over "
                    f"dp alone is FSDP over dp; set mesh.fsdp={spec.deg('dp')} mesh.dp=1 (the "
                    f"same sharding), or keep mesh.fsdp > 1 beside plan.zero=3")
    n = math.prod(spec.deg(a) for a in axes)
    if spec.model.dim % n:
        errs.append(f"model.dim={spec.model.dim} is not divisible by the {n} devices ZeRO++ "
                    f"gathers over ({' x '.join(axes)}): choose degrees that divide it")
    if spec.grad_sync == "step" and spec.accumulate > 1:
        errs.append("plan.zeropp works on each layer's gathers, but plan.grad_sync=step gathers "
                    "every parameter once per step and holds it: use grad_sync=auto or "
                    "microbatch")
    split = [a for a in axes if 1 < spec.dcn.get(a, 1) < spec.deg(a)]
    if "hpz" in parts and split:
        errs.append(f"plan.zeropp=hpz keeps a secondary copy whole over the cross-node gather "
                    f"axes, but the node boundary falls inside mesh.{split[0]} (dcn_{split[0]}="
                    f"{spec.dcn[split[0]]} of {spec.deg(split[0])}): put whole axes across "
                    f"nodes (e.g. mesh.dcn_dp=mesh.dp with plan.zero=3, fsdp inside the node)")
    elif "hpz" in parts and (not cross_axes(spec) or len(cross_axes(spec)) == len(axes)):
        errs.append(f"plan.zeropp=hpz partitions a secondary copy inside each node, but the "
                    f"gather axes ({', '.join(axes)}) are "
                    f"{'all inside one node' if not cross_axes(spec) else 'all across nodes'}: "
                    f"use a hybrid mesh with dp across nodes (mesh.dcn_dp=mesh.dp, plan.zero=3) "
                    f"and fsdp inside")
    return errs


def rules(spec, rules) -> None:
    if not active(spec):
        return
    from jaxscale.axes import MESH_AXES
    rules.set_seam("gather", NAME, by=NAME, axes=gather_axes(spec), cross=cross_axes(spec),
                   hpz="hpz" in parse(spec.zeropp), zero3=spec.zero >= 3,
                   sizes=tuple((a, spec.deg(a)) for a in MESH_AXES),
                   weights=weights_format(spec), grads=grads_format(spec),
                   block=spec.zeropp_block)


@register("gather", NAME)
def _matmul(*args, **kw):
    from jaxscale.strategies.zeropp.gathers import matmul
    return matmul(*args, **kw)


# ----------------------------------------------------------------------------- formulas
def sites(spec):
    """The parameter leaves the seam handles: every weight matmul's (`hooks.projection`), but a
    mixture's routed experts (their slots' and grouped matmuls gather them themselves)."""
    return [leaf for leaf in leaves(spec.model)
            if leaf.use == "dot" and "experts" not in leaf.axes]


def reduced(spec) -> set[str]:
    """The paths of the leaves whose gradients qgZ reduces over the gather axes (`dp`)."""
    if not active(spec) or grads_format(spec) == "none":
        return set()
    return {leaf.path for leaf in sites(spec)}


def region_axes(spec) -> tuple[str, ...]:
    """The gather axes the seam's gathers and qgZ's all-to-alls run over: those of the weights
    as stored, but a data region's (`common.sync_axes`: compression, the sparse embedding, a
    once-per-step mean), whose entry gathers the parameters over it first (`fsdp.collectives`)
    and whose gradients its own mean reduces (dp2 x fsdp2 x sp2, ZeRO-3 + int8 compression:
    the gathers over fsdp alone)."""
    from jaxscale.strategies.common import sync_axes
    once = set(sync_axes(spec))
    return tuple(a for a in gather_axes(spec) if a not in once)


def _gathered_dim(spec, leaf) -> int:
    return next(i for i, a in enumerate(leaf.axes) if a == "embed")


def padded_row(n: int, block: int, even: bool = False) -> int:
    """A quantised row of `n` elements zero-padded to whole blocks of `block_size(n, block,
    even)` (the padding travels: an odd vocabulary's int4 row of 509 as 512)."""
    b = block_size(n, block, even)
    return -(-n // b) * b


def _wire(spec, leaf, fmt: str, block: int, even=False) -> tuple[float, float, int]:
    """(payload bytes, scale bytes, elements) of one row of `leaf`'s shard (its last dimension)
    as `fmt` sends it: the row padded to whole blocks, one fp32 scale per block."""
    if fmt == "none":
        return spec.wire_param_itemsize, 0.0, 1
    d, shape = _gathered_dim(spec, leaf), leaf.local_shape(spec)
    # the shard's last dimension, whole over the gather axes unless it is the gathered one
    last = int(leaf.shape[-1] // math.prod(spec.deg(a) for a in region_axes(spec))
               if d == len(shape) - 1 else shape[-1])
    padded = padded_row(last, block, even)
    per = {"int8": 1.0, "fp8": 1.0, "int4": 0.5}[fmt]
    return per * padded, 4.0 * (padded // block_size(last, block, even)), last


def collectives(spec) -> list[Comm]:
    if not active(spec) or problems(spec):
        return []
    axes = region_axes(spec)
    nodes = tuple(a for a in cross_axes(spec) if a in axes)
    cross = nodes if "hpz" in parse(spec.zeropp) else ()
    local = tuple(a for a in axes if a not in cross)
    n_l = math.prod(spec.deg(a) for a in local)
    k, L = max(1, spec.accumulate), spec.layers_per_device
    wf, gf = weights_format(spec), grads_format(spec)
    rows: dict[tuple, list] = {}

    def add(kind, over, nbytes, count, what, optional=False):
        if over and nbytes > 0:
            row = rows.setdefault((kind, over, what, optional), [0.0, 0])
            row[0] += nbytes
            row[1] += count

    for leaf in sites(spec):
        # runs per step (the head's: per micro-batch, with pipelining on its stage alone)
        reps = L * k if leaf.stacked else outer_runs(spec, leaf)
        # elements of one gathered weight (one layer's, for a stacked leaf)
        E = leaf.run_size(spec, drop=("fsdp",)) / (L if leaf.stacked else 1)
        pb, sb, row = _wire(spec, leaf, wf, spec.zeropp_block)
        R = E / row             # its rows: each travels padded to whole blocks, with its scales
        # outside the layer loop (the LM head): `outer_gathers`, and XLA may reuse the
        # forward's gather for the backward
        once = reps if leaf.stacked else outer_gathers(spec, leaf)
        again = "" if leaf.stacked else ", the LM head's (XLA may reuse the forward's)"
        for what, b in (("payload", pb), ("scales", sb)):
            if b == 0:
                continue
            add("all-gather", cross, R / n_l * b * once, once,
                f"weights over the cross-node axes (hpZ's secondary), {what}")
            add("all-gather", local, R * b * once, once, f"weights, forward, {what}")
            add("all-gather", local, R * b * reps, reps, f"weights, backward, {what}{again}",
                optional=not leaf.stacked)
        if gf != "none":
            pb, sb, row = _wire(spec, leaf, gf, spec.zeropp_block, even=gf == "int4")
            left = E / row
            for a in tuple(a for a in axes if a not in nodes) + nodes:
                for what, b in (("payload", pb), ("scales", sb)):
                    add("all-to-all", (a,), left * b * reps, reps,
                        f"gradients, quantised reduce-scatter, {what}")
                left /= spec.deg(a)
    return [Comm(kind, over, nbytes, count, f"ZeRO++ {what}", optional=optional,
                 group=math.prod(spec.deg(a) for a in over), overlap=True)
            for (kind, over, what, optional), (nbytes, count) in rows.items()]


def memory(spec) -> list[Term]:
    """hpZ: the secondary copy of every layer's matmul weights, whole over the cross-node axes,
    held from the forward to the backward."""
    if not active(spec) or problems(spec) or "hpz" not in parse(spec.zeropp):
        return []
    n_l = math.prod(spec.deg(a) for a in region_axes(spec) if a not in cross_axes(spec))
    held = 0.0
    for leaf in sites(spec):
        if leaf.stacked:        # its rows as the gathers send them (padded blocks, scales)
            pb, sb, row = _wire(spec, leaf, weights_format(spec), spec.zeropp_block)
            held += leaf.run_size(spec, drop=("fsdp",)) / row * (pb + sb)
    return [Term("activations", held / n_l,
                 "hpZ's secondary copy of the layers' weights (node-local partition)")]


def label(spec) -> list[str]:
    out = [f"zero++={spec.zeropp}"] if parse(spec.zeropp) else []
    return out + (["fp8-gather"] if spec.fp8_param_gather else [])
