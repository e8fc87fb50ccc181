"""Hardware profiles: peak FLOP/s, memory, bandwidths. Used for MFU and by the planner.

Figures are vendor dense peaks (no sparsity). `intra_bw` is per-device bus bandwidth inside a
node (NVLink), `inter_bw` per device across nodes (InfiniBand/RoCE NIC), both in bytes/s one way.
The CPU profile describes the host running simulated devices: they share its cores, so its peak is
divided among them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16: float        # FLOP/s per device
    peak_fp32: float
    hbm_bytes: float        # device memory capacity
    hbm_bw: float           # bytes/s
    intra_bw: float         # bytes/s per device, inside a node
    inter_bw: float         # bytes/s per device, across nodes
    intra_latency: float = 5e-6
    inter_latency: float = 15e-6
    host_bw: float = 25e9   # device <-> host (PCIe) bytes/s, for offload


def _cpu() -> Hardware:
    # 2.5 GHz x 32 fp32 FLOP/cycle (two AVX2 FMA units) per core: an upper bound, not a measurement.
    peak = (os.cpu_count() or 1) * 2.5e9 * 32
    return Hardware("cpu", peak, peak, 24e9, 20e9, 10e9, 10e9, 1e-6, 1e-6, 20e9)


HARDWARE: dict[str, Hardware] = {
    "a100": Hardware("a100", 312e12, 19.5e12, 80e9, 2.04e12, 300e9, 25e9),
    "h100": Hardware("h100", 989e12, 67e12, 80e9, 3.35e12, 450e9, 50e9),
    "h200": Hardware("h200", 989e12, 67e12, 141e9, 4.8e12, 450e9, 50e9),
    "cpu": _cpu(),
}


def get(name: str) -> Hardware:
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; valid: {', '.join(HARDWARE)}") from None


def peak_flops_per_device(name: str, dtype: str, n_devices: int) -> float:
    hw = get(name)
    peak = hw.peak_fp32 if dtype == "float32" else hw.peak_bf16
    return peak / n_devices if name == "cpu" else peak
