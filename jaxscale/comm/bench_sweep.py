"""The collectives sweep of `jaxscale.comm.bench`: message sizes, JAX and torch alternating.

`run_sweep(SweepConfig(...))` returns a JSON-able dict: `rows` (one per framework, kind and size),
`handwritten` (the hand-written all-reduces), `alpha_beta` (the model's fit), `meta`. For each
message size S (bytes of the full per-device buffer, as nccl-tests counts it: the all-gather
output, the reduce-scatter input; `sizes` from `min_bytes` to `max_bytes`, `factor` apart) and each
kind, the same collective runs
* in JAX: a jitted `jax.shard_map` over a 1-D mesh (axis `dp`) of the first `world` devices
  (`jaxscale.comm.jax_bench`);
* in torch.distributed (gloo on CPU, NCCL on GPU): a real job of `world` processes on
  localhost (`jaxscale.comm.torch_bench`): all_reduce, all_gather_single,
  reduce_scatter_single, all_to_all_single, broadcast from rank 0, batch_isend_irecv ring shift.
The two alternate at every size and kind (JAX, then torch), so drift hits both. Each point takes
`warmup` untimed and `iters` timed calls; a call is timed alone (torch: after a barrier, the
slowest rank counts) and the point's time is the median. algbw = S / time, busbw = algbw x factor
(all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; broadcast, permute 1). The
hand-written all-reduces of `jaxscale.comm.algorithms` (ring, halving-doubling, recursive
doubling; hierarchical over 2 simulated nodes of n/2 devices) run at every size beside `psum`,
with the alpha-beta prediction (`jaxscale.comm.algorithm_cost`) whose alpha and bandwidth are
fitted to measured JAX ring shifts (one ppermute = one algorithm step; calls of 1 and of 2(n-1)
shifts separate the per-step cost from the cost of launching a jitted call).

jax is imported inside `run_sweep` only.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

from jaxscale.comm import algorithm_cost
from jaxscale.comm.jax_bench import JaxSide
from jaxscale.comm.torch_bench import KINDS, TorchFailure, TorchJob
from jaxscale.cost import busbw_factor

KiB, MiB = 1024, 1024 * 1024
CPU_MAX_BYTES, GPU_MAX_BYTES = 16 * MiB, 256 * MiB


@dataclass
class SweepConfig:
    min_bytes: int = 1 * KiB
    max_bytes: int | None = None      # None: 16 MiB on CPU, 256 MiB on GPU
    factor: int = 4
    iters: int = 10
    warmup: int = 3
    kinds: tuple[str, ...] = KINDS
    world: int | None = None          # None: every JAX device
    torch: bool = True
    torch_backend: str = "auto"       # auto: nccl on GPU, gloo otherwise
    timeout: float = 180.0            # seconds for torch start-up and for each torch point
    handwritten: bool = True

    def validate(self) -> None:
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ValueError(f"unknown collective kind(s) {bad}; valid: {', '.join(KINDS)}")
        if self.min_bytes < 4 or (self.max_bytes is not None and self.max_bytes < self.min_bytes):
            raise ValueError(f"need 4 <= min_bytes <= max_bytes, got {self.min_bytes}, "
                             f"{self.max_bytes}")
        if self.factor < 2 or self.iters < 1 or self.warmup < 0:
            raise ValueError("need factor >= 2, iters >= 1, warmup >= 0")
        if self.world is not None and self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")
        if self.torch_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"torch backend must be auto, gloo or nccl, got {self.torch_backend}")


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def _row(framework: str, kind: str, nbytes: int, n: int, times: list[float]) -> dict:
    t = statistics.median(times)
    algbw = nbytes / t
    factor = busbw_factor(kind, n)
    return dict(framework=framework, kind=kind, nbytes=nbytes, n=n, time_s=t, algbw=algbw,
                factor=factor, busbw=algbw * factor, times=times)


def run_sweep(cfg: SweepConfig, log=print) -> dict:
    """Run the sweep; returns a JSON-able dict (see `bench.save`). Imports jax on first call."""
    cfg.validate()
    import jax
    n_dev = len(jax.devices())
    world = cfg.world or n_dev
    if world > n_dev:
        raise ValueError(f"--world {world} exceeds the {n_dev} JAX devices present (on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={world} before jax "
                         f"is imported)")
    side = JaxSide(world)
    if world == 1:
        log("WARNING: world size 1: every collective is a local copy. On CPU, set XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 before jax is imported (main does).")
    max_bytes = cfg.max_bytes or (CPU_MAX_BYTES if side.platform == "cpu" else GPU_MAX_BYTES)
    swept = sizes(cfg.min_bytes, max_bytes, cfg.factor)
    backend = cfg.torch_backend
    if backend == "auto":
        backend = "nccl" if side.platform == "gpu" else "gloo"
    meta = dict(n=world, jax_platform=side.platform, jax_version=jax.__version__,
                torch_backend=backend if cfg.torch else None, date=time.strftime("%Y-%m-%d %H:%M"),
                cpu_count=os.cpu_count(), xla_flags=os.environ.get("XLA_FLAGS", ""),
                config={k: v for k, v in asdict(cfg).items()}, sizes=swept)
    result: dict = dict(meta=meta, rows=[], handwritten=[], torch_error=None)
    job = None
    if cfg.torch:
        try:
            import torch
            meta["torch_version"] = torch.__version__
            t0 = time.perf_counter()
            job = TorchJob(world, backend, cfg.timeout)
            log(f"torch.distributed ({backend}) world {world} up in {time.perf_counter()-t0:.1f} s")
        except (ImportError, TorchFailure, OSError) as e:
            result["torch_error"] = f"torch side not started: {e}"
            log(f"WARNING: {result['torch_error']}")
    algs = side.algorithms() if cfg.handwritten else []
    chain = max(4, 2 * (world - 1))  # ring shifts per calibration call
    calib: dict[int, tuple[float, float]] = {}  # bytes -> (1 shift, `chain` shifts) per call
    try:
        for i, nbytes in enumerate(swept):
            m = side.elements(nbytes)
            for kind in cfg.kinds:
                times = side.time(kind, nbytes, cfg.iters, cfg.warmup)
                row = _row("jax", kind, m * 4, world, times)
                result["rows"].append(row)
                if job is not None:
                    try:
                        result["rows"].append(_row("torch", kind, m * 4, world,
                                                   job.time(kind, m * 4, cfg.iters, cfg.warmup)))
                    except TorchFailure as e:
                        result["torch_error"] = f"torch failed at {kind} {m * 4} B: {e}"
                        log(f"WARNING: {result['torch_error']}\nContinuing with JAX only.")
                        job.close()
                        job = None
            for alg in algs:
                times = side.time_all_reduce(alg, nbytes, cfg.iters, cfg.warmup, check=i == 0)
                result["handwritten"].append(dict(algorithm=alg, nbytes=m * 4, n=world,
                                                  time_s=statistics.median(times), times=times))
            if algs:  # calibration of the alpha-beta model: 1 and `chain` ring shifts
                calib[m * 4] = tuple(statistics.median(side.time_chain(k, nbytes, cfg.iters,
                                                                       cfg.warmup))
                                     for k in (1, chain))
            log(f"  {nbytes / KiB:>9.0f} KiB done")
    finally:
        if job is not None:
            job.close()
    _add_model(result, calib, chain, world)
    return result


def _add_model(result: dict, calib: dict[int, tuple[float, float]], chain: int, n: int) -> None:
    """Calibrate the alpha-beta model on ring shifts; predict each hand-written all-reduce.

    One step (ring shift of S bytes) costs (t_chain - t_1) / (chain - 1); alpha and bandwidth are
    fitted to those step times, and the rest of t_1 is the fixed cost of launching one jitted
    call (`launch_s`), added once to every prediction.
    """
    psum = {r["nbytes"]: r["time_s"] for r in result["handwritten"] if r["algorithm"] == "psum"}
    for r in result["handwritten"]:
        if r["nbytes"] in psum:
            r["vs_psum"] = r["time_s"] / psum[r["nbytes"]]
    sizes_ = sorted(calib)
    steps = [(calib[s][1] - calib[s][0]) / (chain - 1) for s in sizes_]
    try:
        alpha, bw = algorithm_cost.fit_alpha_beta(sizes_, steps)
    except ValueError as e:
        result["alpha_beta"] = dict(error=f"no alpha-beta fit: {e}")
        return
    launch = max(statistics.median(calib[s][0] - alpha - s / bw for s in sizes_), 0.0)
    result["alpha_beta"] = dict(alpha_s=alpha, bandwidth_Bps=bw, launch_s=launch,
                                fitted_on=f"jax ring shifts, 1 and {chain} per call",
                                calibration={str(s): list(calib[s]) for s in sizes_})
    for r in result["handwritten"]:
        alg = r["algorithm"]
        if alg != "psum":
            r["predicted_s"] = launch + algorithm_cost.predict_time(
                alg, "all_reduce", r["nbytes"], n, alpha, bw,
                n_inner=n // 2 if alg == "hierarchical" else None)
