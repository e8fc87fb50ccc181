"""Mesh configuration: a degree per mesh axis, optional intra/inter-node split, validation.

Axes, outer to inner: `dp, pp, fsdp, ep, sp, tp` (inner = fastest link). A degree of -1 means
"whatever is left". `dcn_<axis>` gives how many of an axis's degree lie *across* nodes (the outer,
DCN-like part); the rest stays inside a node (ICI/NVLink-like). On a real multi-host job the mesh
is built with `mesh_utils.create_hybrid_device_mesh`; in a single process the devices are grouped
into simulated nodes in id order, so the same layout can be studied on 8 CPU devices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxscale.axes import MESH_AXES
from jaxscale.fields import one_of, positive, ranged
from jaxscale.hardware import HARDWARE


@dataclass(frozen=True)
class MeshConfig:
    dp: int = ranged(1, lo=1, also=(-1,), note="-1: fill with the devices left")
    pp: int = ranged(1, lo=1, also=(-1,), note="-1: fill with the devices left")
    fsdp: int = ranged(1, lo=1, also=(-1,), note="-1: fill with the devices left")
    ep: int = ranged(1, lo=1, also=(-1,), note="-1: fill with the devices left")
    sp: int = ranged(1, lo=1, also=(-1,), note="-1: fill with the devices left")
    tp: int = ranged(1, lo=1, also=(-1,), note="-1: fill with the devices left")
    dcn_dp: int = positive(1)
    dcn_pp: int = positive(1)
    dcn_fsdp: int = positive(1)
    dcn_ep: int = positive(1)
    dcn_sp: int = positive(1)
    dcn_tp: int = positive(1)
    #: hardware name for peak FLOP/s and bandwidths (see `jaxscale.hardware`).
    device_kind: str = one_of("cpu", *HARDWARE)

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    def dcn_degrees(self) -> dict[str, int]:
        return {a: getattr(self, f"dcn_{a}") for a in MESH_AXES}

    @property
    def nodes(self) -> int:
        return math.prod(self.dcn_degrees().values())

    def resolve(self, n_devices: int) -> "MeshConfig":
        """Fill a -1 degree and check that the degrees multiply to `n_devices`."""
        deg = self.degrees()
        bad = {a: d for a, d in deg.items() if d == 0 or d < -1}
        if bad:
            raise ValueError(f"mesh degrees must be positive (or -1 to fill): got {bad}")
        fill = [a for a, d in deg.items() if d == -1]
        if len(fill) > 1:
            raise ValueError(f"only one mesh degree may be -1 (fill), got {fill}")
        known = math.prod(d for d in deg.values() if d != -1)
        if fill:
            if n_devices % known:
                raise ValueError(
                    f"cannot fill mesh axis {fill[0]!r}: the other degrees multiply to {known}, "
                    f"which does not divide the {n_devices} devices present")
            deg[fill[0]] = n_devices // known
        total = math.prod(deg.values())
        if total != n_devices:
            asked = " x ".join(f"{a}={d}" for a, d in deg.items() if d != 1) or "all degrees 1"
            raise ValueError(
                f"mesh asks for {asked} = {total} devices but {n_devices} are present. Make the "
                f"degrees multiply to {n_devices} (e.g. --set mesh.dp=-1 to fill dp with what is "
                "left), or change the device count "
                "(XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU)")
        for a in MESH_AXES:
            o = getattr(self, f"dcn_{a}")
            if o < 1 or deg[a] % o:
                raise ValueError(f"dcn_{a}={o} must be >= 1 and divide {a}={deg[a]}")
        if n_devices % self.nodes:
            raise ValueError(f"{self.nodes} nodes (product of dcn_* degrees) do not divide "
                             f"{n_devices} devices")
        return replace(self, **deg)

    def active_axes(self) -> tuple[str, ...]:
        return tuple(a for a in MESH_AXES if getattr(self, a) > 1)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """Build a `Mesh` with all six axes (size-1 axes included) in Auto (GSPMD) mode."""
    devices = list(devices if devices is not None else jax.devices())
    cfg = cfg.resolve(len(devices))
    shape = tuple(cfg.degrees().values())
    types = (AxisType.Auto,) * len(MESH_AXES)
    if cfg.nodes == 1:
        arr = np.array(sorted(devices, key=lambda d: d.id)).reshape(shape)
        return Mesh(arr, MESH_AXES, axis_types=types)
    outer = tuple(cfg.dcn_degrees().values())
    inner = tuple(d // o for d, o in zip(shape, outer))
    if jax.process_count() > 1:
        from jax.experimental import mesh_utils
        arr = mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=True)
    else:  # simulated nodes: consecutive device ids form one node
        per_node = len(devices) // cfg.nodes
        ordered = np.array(sorted(devices, key=lambda d: d.id)).reshape(cfg.nodes, per_node)
        arr = ordered.reshape(outer + inner)
        n = len(MESH_AXES)
        arr = arr.transpose([i for pair in zip(range(n), range(n, 2 * n)) for i in pair])
        arr = arr.reshape(shape)
    return Mesh(arr, MESH_AXES, axis_types=types)
