"""Named meshes: presets, and cluster names for any number of nodes. `get(name)` returns a
`MeshConfig`; `PRESETS` lists the presets, `devices(name)` a name's device count.

| name      | devices | layout                                   | hardware |
|-----------|---------|------------------------------------------|----------|
| cpu8      | 8       | dp=2 x fsdp=2 x tp=2 (simulated CPU)     | cpu      |
| cpu1      | 1       | single device                            | cpu      |
| h200x1    | 1       | single H200                              | h200     |
| h100x8    | 8       | fsdp=8 inside one NVLink node            | h100     |
| h100x8x2  | 16      | 2 nodes: dp=2 across, fsdp=8 inside      | h100     |
| h100x8x4  | 32      | 4 nodes: dp=4 across, fsdp=2 x tp=4 in   | h100     |

A cluster name `<kind>x<gpus-per-node>x<nodes>` (`h100x8x8`: 64 H100s on 8 nodes; `h200x8x32`,
`a100x8x4`; `<kind>x<gpus>` for one node; `cpux4x2`: 8 simulated CPU devices as 2 nodes) names
the hardware profile (`jaxscale.hardware`), the device count and the node split. Its degrees
multiply to the device count, so it needs no `--devices`: FSDP over the devices of a node, data
parallelism across the nodes (`dp = dcn_dp = nodes`). `--set mesh.X=...` changes them, and
`jaxscale plan --search` or `train --plan auto` replaces them with the fastest layout that fits.
A preset of the same name keeps its own layout (`h100x8x4`).
"""
import math
import re

from jaxscale.hardware import HARDWARE
from jaxscale.mesh import MeshConfig

PRESETS: dict[str, MeshConfig] = {
    "cpu8": MeshConfig(dp=2, fsdp=2, tp=2, device_kind="cpu"),
    "cpu1": MeshConfig(device_kind="cpu"),
    "h200x1": MeshConfig(device_kind="h200"),
    "h100x8": MeshConfig(fsdp=8, device_kind="h100"),
    "h100x8x2": MeshConfig(dp=2, fsdp=8, dcn_dp=2, device_kind="h100"),
    "h100x8x4": MeshConfig(dp=4, fsdp=2, tp=4, dcn_dp=4, device_kind="h100"),
}
PATTERN = "<kind>x<gpus-per-node>x<nodes>"


def cluster(name: str) -> MeshConfig:
    """The `MeshConfig` of a cluster name (ValueError saying what is wrong with it)."""
    parts = name.strip().lower().split("x")
    counts = []
    while len(parts) > 1 and len(counts) < 2 and (parts[-1].isdigit() or not parts[-1]):
        counts.insert(0, parts.pop())
    kind = "x".join(parts)
    if not kind or not counts:
        raise ValueError(_unknown(name, f"it does not look like {PATTERN}"))
    if kind not in HARDWARE:
        raise ValueError(_unknown(name, "at most two counts: gpus per node and nodes"
                                  if re.search(r"x\d*$", kind) else
                                  f"unknown device kind {kind!r}"))
    if not all(counts):
        raise ValueError(_unknown(name, "give both counts as numbers: gpus per node and nodes "
                                        "(e.g. h100x8x8)"))
    gpus, nodes = (int(c) for c in (counts + ["1"])[:2])
    if gpus < 1 or nodes < 1:
        raise ValueError(_unknown(name, "gpus per node and nodes must be at least 1"))
    per_node = HARDWARE[kind].devices_per_node
    if gpus > per_node:
        raise ValueError(_unknown(name, f"a {kind} node holds at most {per_node} devices"))
    return MeshConfig(dp=nodes, fsdp=gpus, dcn_dp=nodes, device_kind=kind)


def get(name: str) -> MeshConfig:
    """A preset, else a cluster name (ValueError listing the presets and the pattern)."""
    if name in PRESETS:
        return PRESETS[name]
    return cluster(name)


def devices(name: str) -> int:
    """The device count a preset or cluster name stands for (its degrees' product)."""
    return math.prod(get(name).degrees().values())


def _unknown(name: str, why: str) -> str:
    kinds = ", ".join(HARDWARE)
    return (f"unknown mesh preset {name!r}; valid: {', '.join(PRESETS)}, or a cluster name "
            f"{PATTERN} (e.g. h100x8x8, h200x8x32, a100x8x4; <kind>x<gpus> for one node; kind "
            f"one of {kinds}): {why}")
