"""Hardware profiles: peak FLOP/s, memory, bandwidths. Used for MFU and by the planner.

Figures are vendor dense peaks (no sparsity). `intra_bw` is per-device bus bandwidth inside a
node (NVLink), `inter_bw` per device across nodes (InfiniBand/RoCE NIC), both in bytes/s one way.
The CPU profile describes the host running simulated devices: they share its cores, so its peak is
divided among them.

Fields the planner adds (defaults keep the older profiles' meaning):
- `busbw_intra` / `busbw_inter`: the bus bandwidth a bandwidth-optimal collective reaches
  (nccl-tests "busbw"), per device; 0 means the link bandwidth (`intra_bw` / `inter_bw`). 8xH100
  ring all-reduce ~370 GB/s, 8xA100 ~200 GB/s (nccl-tests PERFORMANCE.md figures in REFERENCE.md).
- `matmul_efficiency`: fraction of the dense peak the GEMMs of a training step sustain. The
  best-shape matmul rate (MAMF, ml-engineering's `mamf-finder.py` table: A100 SXM 267.9, H100
  SXM 792.1 of 312 / 989 TFLOP/s; ~790 measured on the H200, ../shared/gpu) is not what a step's
  GEMMs reach: on the H200 the jaxscale step's GEMM kernels ran 5.6e13 FLOPs in ~90 ms (0.626
  of the peak, 0.78 of the measured best shape; ../shared/gpu/README.md, profile). The profiles
  take that 0.78 of their MAMF: A100 0.67, H100 0.625, H200 0.626 (measured). The CPU
  peak is already an upper bound (1.0).
- `attention_efficiency`: fraction of the dense peak a fused attention kernel (cuDNN,
  FlashAttention-2/3) sustains over its forward and backward, FLOPs counted as the planner does
  (the causal half, the backward 2.5x the forward): FlashAttention-2 on A100 ~170 of 312 TFLOP/s
  at head_dim 128 and 2-16k tokens (Dao 2023, arXiv 2307.08691, fig. 5); on the H200 the
  jaxscale step's cuDNN kernels ran 5.8 TFLOP in 12 ms (0.49 of 989: ../shared/gpu/README.md,
  profile), FlashAttention-3 on H100 ~500-600 TFLOP/s forward+backward (arXiv 2407.08608).
- `peak_fp8`, `peak_int8`: dense 8-bit matmul peaks (0: no 8-bit tensor cores): H100/H200
  1979 TFLOP/s fp8 and 1979 TOP/s int8, A100 624 TOP/s int8 and no fp8 (vendor datasheets).
- `host_bytes`: host DRAM per device for offloaded state (a DGX node: 2 TB for 8 GPUs); on `cpu`,
  the machine's physical memory, which the simulated devices share.
- `disk_bw`: NVMe bandwidth per device for the nvme offload tier (a DGX H100's 8 NVMe drives,
  ~25 GB/s read together, ~3 GB/s per GPU); `host_update_rate`: parameters per second the host
  CPU's vectorised AdamW updates per device (ZeRO-Offload's CPU-Adam: ~1e9/s per GPU's share
  of a node's cores).
- `devices_per_node`: devices behind one fast interconnect (NVLink domain).
- `native_16bit`: whether the backend computes and communicates in bf16/fp16. XLA:CPU does not:
  it normalises 16-bit arithmetic to f32 and promotes 16-bit collectives to f32, so the census
  counts 16-bit collectives at 4 bytes there (measured with `jaxscale inspect`).
- `held_16bit`: the 16-bit float dtypes the backend's buffers hold at 2 bytes. XLA:CPU holds
  float16 activations, gradients and temporaries as they are and widens only bfloat16's to f32
  (the same plan's compiled temp, dim 160, 5 layers: dp8 fp32 8.9 MB, bf16 9.1, fp16 5.5).
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
    disk_bw: float = 3e9    # NVMe <-> host bytes/s per device (the node's drives shared)
    host_update_rate: float = 1e9   # parameters/s per device the host CPU's AdamW updates
    busbw_intra: float = 0.0
    busbw_inter: float = 0.0
    matmul_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    peak_fp8: float = 0.0
    peak_int8: float = 0.0
    host_bytes: float = 256e9
    devices_per_node: int = 8
    native_16bit: bool = True
    held_16bit: tuple[str, ...] = ("bfloat16", "float16")

    def collective_bw(self, cross_node: bool) -> float:
        """Bus bandwidth per device for a collective inside a node or across nodes."""
        if cross_node:
            return self.busbw_inter or self.inter_bw
        return self.busbw_intra or self.intra_bw

    def latency(self, cross_node: bool) -> float:
        return self.inter_latency if cross_node else self.intra_latency


def simulate_cpu_devices(n: int = 8) -> bool:
    """Ask XLA for `n` simulated CPU devices (`--xla_force_host_platform_device_count`) unless
    JAX is already imported or XLA_FLAGS already sets a count; harmless on a GPU machine (the
    flag only shapes the CPU backend). Call before JAX starts (the CLI, the experiments and the
    benchmarks do); returns whether the flag was set."""
    import sys
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" in sys.modules or "xla_force_host_platform_device_count" in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    return True


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def _cpu() -> Hardware:
    # 2.5 GHz x 32 fp32 FLOP/cycle (two AVX2 FMA units) per core: an upper bound, not a measurement.
    peak = (os.cpu_count() or 1) * 2.5e9 * 32
    return Hardware("cpu", peak, peak, 24e9, 20e9, 10e9, 10e9, 1e-6, 1e-6, 20e9,
                    host_bytes=_host_memory(), devices_per_node=1 << 16, native_16bit=False,
                    held_16bit=("float16",))


HARDWARE: dict[str, Hardware] = {
    "a100": Hardware("a100", 312e12, 19.5e12, 80e9, 2.04e12, 300e9, 25e9,
                     busbw_intra=200e9, matmul_efficiency=0.67, attention_efficiency=0.55,
                     peak_int8=624e12),
    # Jean Zay's A100 partition, where BLOOM trained: 4 Omni-Path links of 100 Gb/s per node of
    # 8 A100 (bigscience tr11-176B-ml README, "Hardware"): 6.25 GB/s per GPU across nodes
    "a100-opa": Hardware("a100-opa", 312e12, 19.5e12, 80e9, 2.04e12, 300e9, 6.25e9,
                         busbw_intra=200e9, matmul_efficiency=0.67, attention_efficiency=0.55,
                         peak_int8=624e12),
    "h100": Hardware("h100", 989e12, 67e12, 80e9, 3.35e12, 450e9, 50e9,
                     busbw_intra=370e9, matmul_efficiency=0.625, attention_efficiency=0.5,
                     peak_fp8=1979e12, peak_int8=1979e12),
    "h200": Hardware("h200", 989e12, 67e12, 141e9, 4.8e12, 450e9, 50e9,
                     busbw_intra=370e9, matmul_efficiency=0.626, attention_efficiency=0.5,
                     peak_fp8=1979e12, peak_int8=1979e12),
    "cpu": _cpu(),
}


def get(name: str) -> Hardware:
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; valid: {', '.join(HARDWARE)}") from None


def peak_flops_per_device(name: str, dtype: str, n_devices: int) -> float:
    """Dense peak FLOP/s of one device in `dtype` (simulated CPU devices share the host's)."""
    hw = get(name)
    peak = hw.peak_fp32 if dtype == "float32" else hw.peak_bf16
    return peak / n_devices if name == "cpu" else peak


def peak_8bit(name: str, kind: str) -> float:
    """Dense peak of 8-bit matmuls (`kind`: fp8 | int8) on one device; 0 where the hardware has
    no such tensor cores (the matmuls then run at the compute dtype's peak)."""
    hw = get(name)
    return hw.peak_fp8 if kind == "fp8" else hw.peak_int8 if kind == "int8" else 0.0


def mfu(flops: float, seconds: float, device_kind: str, compute_dtype: str, n_devices: int,
        peak: float = 0.0) -> float:
    """Model FLOPs utilisation, the one definition the train loop, inspect and the planner use:
    model FLOPs / (seconds x the peak FLOP/s of the plan's compute dtype x devices). `peak`
    (per device, `train.peak_flops`) overrides the table; the compute dtype is the plan's
    (`precision.compute_dtype`), never the model's parameter dtype."""
    if seconds <= 0:
        return 0.0
    per_device = peak or peak_flops_per_device(device_kind, compute_dtype, n_devices)
    return flops / (seconds * per_device * n_devices)
