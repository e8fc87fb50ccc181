"""Host offload of train state: optimizer moments, fp32 master weights and/or working parameters
resident in host memory (`pinned_host` memory kind) between steps, and streamed through the
device by the optimizer update one layer at a time.

The step: the working parameters come to the device whole for the forward and backward (when
`params` is offloaded); the optimizer state and the master weights do not come over for them at
all. The update then runs as a loop over the layer-stacked leaves (`streamed_update`): iteration i
brings layer i of the moments, master weights and parameters to the device, applies the AdamW
update (clipped by the global gradient norm, computed once before the loop), sends the new values
back and writes them in place into the state's own (donated) host buffers (`streaming.py`); the next
layer is fetched as soon as this one is written (under ZeRO with the layers split over dp, one layer
of each device's own block per iteration). The embedding, head and final norm (not stacked) go one
leaf at a time, whole, after the loop: at most one layer's state, or one such leaf's, is on the
device at a time.

Memory: device-resident state falls by exactly the offloaded bytes (Adam moments alone are 8 of
the 16 bytes/param), and so does the device peak where the backward sets it (it holds none of
the offloaded state); the update phase holds the gradients plus one piece (a layer's state, its
update and its gradient slice in fp32, `piece_bytes`) instead of a copy of the whole state. Cost:
each step moves every offloaded byte to the device and back, 2 x offloaded bytes over PCIe (~25 GB/s
per GPU, vs ~4 TB/s HBM); the layer loop overlaps one layer's copies with the next layer's compute
only partly (a layer is fetched after the previous one is written), so the planner's step-time model
charges the traffic unhidden. Collectives: none added. Activation offload goes through the remat
policy (`plan.remat=offload`), not here. `plan.offload_tier=nvme` (files, ZeRO-Infinity) and
`plan.offload_update=host` (the host CPU's AdamW, ZeRO-Offload, optionally one step delayed) are
`tiers.py`, driven from the host by `driver.py`.
"""
from __future__ import annotations

import functools

from jaxscale.strategies import local_sgd, precision, zero
from jaxscale.strategies.common import Term, parse_parts, problems_of
from jaxscale.strategies.offload import tiers
from jaxscale.strategies.tables.params import leaves

NAME = "offload"
AVAILABLE = True
PARTS = ("optimizer", "master", "params")
HOST = "pinned_host"


def parse(value: str) -> frozenset[str]:
    """The parts of `plan.offload` ("none", or parts joined with '+')."""
    return parse_parts(value, PARTS, "plan.offload", "optimizer+master")


# ----------------------------------------------------------------------------- protocol
def active(spec) -> bool:
    return not problems(spec) and bool(parse(spec.offload))


def problems(spec) -> list[str]:
    errs = problems_of(parse, spec.offload)
    if errs:
        return errs
    if "master" in parse(spec.offload) and not spec.mixed:
        return [f"plan.offload includes 'master' but plan.precision={spec.precision} keeps no "
                f"separate fp32 master weights; offload 'params' or 'optimizer', or use bf16/fp16"]
    return tiers.problems(spec)


def runnable(spec) -> list[str]:
    """The host-driven tiers' limits (`tiers.runnable`)."""
    return tiers.runnable(spec) if active(spec) else []


def rules(spec, rules) -> None:
    """Offload adds no sharding rule (the state keeps its shardings, in host memory)."""


def collectives(spec) -> list:
    """None: the device<->host copies are PCIe transfers, charged by the planner's time model."""
    return []


def memory(spec) -> list[Term]:
    """Each offloaded part leaves device memory for host memory, byte for byte; and the update
    phase holds one streamed piece of it on the device. The host-driven tiers (nvme, the host
    update): `_driven_memory`."""
    if not active(spec):
        return []
    state = precision.state_bytes(spec)
    if spec.local_sgd != "none":        # its opt_state is the outer optimizer's
        state = {**state, "optimizer": local_sgd.outer_state_bytes(spec)}
    if tiers.driven(spec):
        return _driven_memory(spec, state)
    out = []
    for part in PARTS:
        if part in parse(spec.offload):
            out += [Term(part, -state[part], f"{part} offloaded to host memory"),
                    Term("host", state[part], f"{part} in host memory", part=part)]
    if spec.local_sgd != "none":        # local SGD's own step brings them over whole
        return out + [Term("update", sum(state[p] for p in parse(spec.offload)),
                           "the offloaded parts, on the device for local SGD's step")]
    return out + [Term("update", piece_bytes(spec),
                       "one streamed piece: a layer's state, its update, its fp32 gradient")]


def _driven_memory(spec, state) -> list[Term]:
    """The host-driven tiers: the parts leave the device; the store is one logical copy for the
    process (per device: its share), on disk under the nvme tier with only the streamed pieces
    in host RAM, in host RAM under the host tier (`tiers.host_ram_bytes`)."""
    n = spec.n_devices
    out = [Term(part, -state[part], f"{part} offloaded ({spec.offload_tier} tier)")
           for part in PARTS if part in parse(spec.offload)]
    if spec.offload_tier == "nvme":
        out += [Term("disk", v / n, f"{part} in files under plan.offload_dir", part=part)
                for part, v in tiers.store_parts(spec).items()]
    what = {"pieces": "the store's pieces in flight (read-ahead, update, write-behind)",
            "params": "the new working parameters, before they go to the devices"}
    out += [Term("host", v / n, what.get(k, f"{k} in host memory (one logical copy)"), part=k)
            for k, v in tiers.host_ram_bytes(spec).items()]
    if spec.offload_update == "device":
        out.append(Term("update", piece_bytes(spec),
                        "one streamed piece: a layer's state, its update, its fp32 gradient"))
    return out


def piece_bytes(spec) -> float:
    """Device bytes of the largest piece of the streamed update, per device: one iteration of
    the layer loop (a layer of the working parameters, master weights and moments, and of the
    gradients in fp32), or the largest unstacked leaf (embedding or head) with the same parts.
    On XLA:CPU (one memory: a `device_put` of a slice is no copy) the update writes straight
    into the carry; on a GPU the host-homed parts' new values wait on the device for their copy
    back, one piece more of those parts."""
    sh = zero.shards(spec)
    moment = 4 if spec.mixed else spec.param_itemsize
    per_elem = {"params": spec.param_itemsize, "master": 4 if spec.mixed else 0,
                "optimizer": spec.moments * moment, "grads": 4}
    if spec.device_kind != "cpu":
        for part in parse(spec.offload):
            per_elem[part] = 2 * per_elem[part]
    elems = {"params": sh.params, "master": sh.optimizer, "optimizer": sh.optimizer,
             "grads": sh.optimizer}
    ls = leaves(spec.model)
    total = sum(leaf.size for leaf in ls)
    stacked = sum(leaf.size for leaf in ls if leaf.stacked)
    n_layers, dp = spec.model.n_layers, spec.deg("dp")
    # ZeRO splits the leading (layers) dimension over dp when nothing else takes it: each
    # iteration then takes one layer from each device's own block of layers
    width = dp if (zero.stage(spec) and dp > 1 and spec.deg("fsdp") == 1
                   and n_layers % dp == 0) else 1
    layer = sum(elems[k] * stacked / total * width / n_layers * b for k, b in per_elem.items())
    unstacked = max((leaf.size for leaf in ls if not leaf.stacked), default=0)
    leaf = sum(elems[k] * unstacked / total * b for k, b in per_elem.items())
    return float(max(layer, leaf))


def label(spec) -> list[str]:
    return [f"offload={spec.offload}"] if active(spec) else []


# ----------------------------------------------------------------------------- the step
def shape_step(spec, parts) -> None:
    """The state: the offloaded parts in host memory between steps. The step: the update
    streamed through the device layer by layer (`streaming.py`)."""
    if active(spec):
        parts.set("memory_kinds", {part: HOST for part in parse(spec.offload)}, by=NAME)
        parts.set("update", _streamed, by=NAME)
        if tiers.driven(spec):          # the nvme tier, the host update: driven from the host
            parts.set("train_step", functools.partial(_driven, spec), by=NAME)


def _driven(spec, ctx):
    from jaxscale.strategies.offload.driver import Step
    return Step(ctx, spec, spec.optim)


def _streamed(ctx):
    from jaxscale.strategies.offload.streaming import streamed
    return streamed(ctx)
