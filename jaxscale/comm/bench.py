"""Collectives sweep in the style of nccl-tests: JAX shard_map collectives against torch.distributed.

    python -m jaxscale.comm.bench [--min-bytes 1024 --max-bytes 16M --factor 4 --iters 10]
    jaxscale bench collectives ...         (same arguments)

For each message size S (bytes of the full per-device buffer, as nccl-tests counts it: the
all-gather output, the reduce-scatter input) and each kind, the same collective runs
* in JAX: a jitted `jax.shard_map` over a 1-D mesh (axis `dp`) of the first `--world` devices,
  float32: all_reduce = `psum`; all_gather = `all_gather(tiled)` of S/n per device;
  reduce_scatter = `psum_scatter(tiled)`; all_to_all = `all_to_all(tiled)`; permute = `ppermute`
  ring shift i -> i+1; broadcast = `psum` of the buffer masked to zero off device 0. JAX has no
  broadcast collective inside shard_map; the masked psum is what replicating one device's value
  costs there, an all-reduce, so its busbw (factor 1) understates what a real broadcast reaches.
* in torch.distributed (gloo on CPU, NCCL on GPU): a real job of `--world` processes on
  localhost (`jaxscale.comm.torch_bench`): all_reduce, all_gather_single,
  reduce_scatter_single, all_to_all_single, broadcast from rank 0, batch_isend_irecv ring shift.
The two alternate at every size and kind (JAX, then torch), so drift hits both. Each point takes
`--warmup` untimed and `--iters` timed calls; a call is timed alone (torch: after a barrier, the
slowest rank counts) and the point's time is the median. algbw = S / time, busbw = algbw x factor
(all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; broadcast, permute 1), and
the JAX/torch busbw ratio is reported per size. The hand-written all-reduces of
`jaxscale.comm.algorithms` (ring, halving-doubling, recursive doubling; hierarchical over 2 simulated
nodes of n/2 devices) run at every size beside `psum`, with the alpha-beta prediction whose alpha
and bandwidth are fitted to measured JAX ring shifts (one ppermute = one algorithm step; calls of
1 and of 2(n-1) shifts separate the per-step cost from the cost of launching a jitted call).

Simulated CPU devices: `main` sets `XLA_FLAGS=--xla_force_host_platform_device_count=max(8,
world)` when jax is not yet imported and the flag is absent. They share the host's cores, so
absolute CPU figures mean little; the JAX/torch ratio measured in one run is the result.
Outputs: a printed table, `collectives.json` and `collectives.png` under `--out`. Exit status: 0;
1 if the torch side failed (the JAX results are still printed and saved); 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxscale.comm.torch_bench import KINDS, TorchFailure, TorchJob
from jaxscale.cost import busbw_factor
from jaxscale.fields import arg, dir_problem
from jaxscale.hardware import simulate_cpu_devices
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




# ---------------------------------------------------------------------------------------------
# JAX side
# ---------------------------------------------------------------------------------------------
class JaxSide:
    """Jitted shard_map collectives over a 1-D mesh (axis `dp`) of the first `world` devices."""

    def __init__(self, world: int):
        import jax
        from jaxscale.mesh import MeshConfig, make_mesh
        devices = jax.devices()[:world]
        self.n, self.platform = world, devices[0].platform
        self.mesh = make_mesh(MeshConfig(dp=world), devices=devices)
        self.mesh2 = None
        if world >= 4 and world % 2 == 0:  # two simulated nodes of world/2 devices
            self.mesh2 = make_mesh(MeshConfig(dp=2, fsdp=world // 2, dcn_dp=2), devices=devices)
        self._fns: dict = {}

    def elements(self, nbytes: int) -> int:
        """float32 elements per device: a multiple of n, at least n."""
        return max(nbytes // 4 // self.n, 1) * self.n

    def _fn(self, kind: str):
        if kind in self._fns:
            return self._fns[kind]
        import jax
        from jax.sharding import PartitionSpec as P
        ax, n, lax = "dp", self.n, jax.lax
        bodies = {
            "all_reduce": lambda b: lax.psum(b, ax),
            "all_gather": lambda b: lax.all_gather(b, ax, tiled=True),
            "reduce_scatter": lambda b: lax.psum_scatter(b, ax, tiled=True),
            "all_to_all": lambda b: lax.all_to_all(b, ax, 0, 0, tiled=True),
            "broadcast": lambda b: lax.psum(jax.numpy.where(lax.axis_index(ax) == 0, b, 0), ax),
            "permute": lambda b: lax.ppermute(b, ax, [(j, (j + 1) % n) for j in range(n)]),
        }
        if kind not in bodies:
            raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")
        fn = jax.jit(jax.shard_map(bodies[kind], mesh=self.mesh, in_specs=P(ax),
                                   out_specs=P(ax)))
        self._fns[kind] = fn
        return fn

    def _chain(self, k: int):
        """k ring shifts in a row inside one jitted call (k collective-permutes)."""
        if ("chain", k) not in self._fns:
            import jax
            from jax.sharding import PartitionSpec as P
            ring = [(j, (j + 1) % self.n) for j in range(self.n)]

            def body(b):
                for _ in range(k):
                    b = jax.lax.ppermute(b, "dp", ring)
                return b
            self._fns["chain", k] = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P("dp"),
                                                          out_specs=P("dp")))
        return self._fns["chain", k]

    def time_chain(self, k: int, nbytes: int, iters: int, warmup: int) -> list[float]:
        from jax.sharding import PartitionSpec as P
        x = self._input((self.n * self.elements(nbytes),), self.mesh, P("dp"))
        return _time_calls(self._chain(k), x, iters, warmup)

    def _input(self, shape, mesh, spec):
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        return jax.device_put(np.ones(shape, np.float32), NamedSharding(mesh, spec))

    def time(self, kind: str, nbytes: int, iters: int, warmup: int) -> list[float]:
        from jax.sharding import PartitionSpec as P
        m = self.elements(nbytes)
        shape = (m,) if kind == "all_gather" else (self.n * m,)  # global; S/n or S per device
        return _time_calls(self._fn(kind), self._input(shape, self.mesh, P("dp")), iters, warmup)

    def algorithms(self) -> list[str]:
        pow2 = self.n & (self.n - 1) == 0
        algs = ["psum", "ring"] + (["halving_doubling", "recursive_doubling"] if pow2 else [])
        return algs + (["hierarchical"] if self.mesh2 is not None else [])

    def time_all_reduce(self, algorithm: str, nbytes: int, iters: int, warmup: int,
                        check: bool = False) -> list[float]:
        from jax.sharding import PartitionSpec as P
        from jaxscale.comm import algorithms as C
        two = algorithm == "hierarchical"
        mesh, axes = (self.mesh2, ("dp", "fsdp")) if two else (self.mesh, ("dp",))
        fn = C.all_reduce_fn(mesh, axes, algorithm)
        x = self._input((self.n, self.elements(nbytes)), mesh, P(axes if two else "dp"))
        if check:  # each row of the result is the sum of the n rows of ones
            import numpy as np
            got = np.asarray(fn(x))
            if not np.allclose(got, self.n):
                raise AssertionError(f"{algorithm} all-reduce gave {got.ravel()[:4]}, "
                                     f"expected {self.n}")
        return _time_calls(fn, x, iters, warmup)


def _time_calls(fn, x, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn(x).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------------------
def _row(framework: str, kind: str, nbytes: int, n: int, times: list[float]) -> dict:
    t = statistics.median(times)
    algbw = nbytes / t
    factor = busbw_factor(kind, n)
    return dict(framework=framework, kind=kind, nbytes=nbytes, n=n, time_s=t, algbw=algbw,
                factor=factor, busbw=algbw * factor, times=times)


def run_sweep(cfg: SweepConfig, log=print) -> dict:
    """Run the sweep; returns a JSON-able dict (see `save`). Imports jax on first call."""
    cfg.validate()
    import jax
    from jaxscale.comm import algorithms as C
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
                row = _row("jax", kind, m * 4, world, side.time(kind, nbytes, cfg.iters, cfg.warmup))
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
    _add_model(result, calib, chain, world, C)
    return result


def _add_model(result: dict, calib: dict[int, tuple[float, float]], chain: int, n: int,
               C) -> None:
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
        alpha, bw = C.fit_alpha_beta(sizes_, steps)
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
            r["predicted_s"] = launch + C.predict_time(
                alg, "all_reduce", r["nbytes"], n, alpha, bw,
                n_inner=n // 2 if alg == "hierarchical" else None)


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
def fmt_size(b: float) -> str:
    return f"{b / MiB:.0f} MiB" if b >= MiB else f"{b / KiB:.0f} KiB" if b >= KiB else f"{b:.0f} B"


def ratios(result: dict) -> list[dict]:
    """JAX busbw / torch busbw per kind and size (where both ran)."""
    torch_rows = {(r["kind"], r["nbytes"]): r for r in result["rows"] if r["framework"] == "torch"}
    out = []
    for r in result["rows"]:
        t = torch_rows.get((r["kind"], r["nbytes"]))
        if r["framework"] == "jax" and t is not None:
            out.append(dict(kind=r["kind"], nbytes=r["nbytes"],
                            ratio=r["algbw"] / t["algbw"]))  # = busbw ratio (same factor)
    return out


def format_report(result: dict) -> str:
    meta, lines = result["meta"], []
    rat = {(q["kind"], q["nbytes"]): q["ratio"] for q in ratios(result)}
    by = {(r["framework"], r["kind"], r["nbytes"]): r for r in result["rows"]}
    lines.append(f"collectives sweep: n={meta['n']} {meta['jax_platform']} devices, "
                 f"JAX {meta['jax_version']} vs torch {meta.get('torch_version', '-')} "
                 f"({meta['torch_backend'] or 'off'}); time = median of {meta['config']['iters']}")
    head = (f"{'size':>8} {'jax us':>10} {'algbw':>7} {'busbw':>7} | {'torch us':>10} "
            f"{'algbw':>7} {'busbw':>7} | {'jax/torch busbw':>15}")
    for kind in meta["config"]["kinds"]:
        f = busbw_factor(kind, meta["n"])
        lines += ["", f"{kind}  (busbw factor {f:.3f}, bandwidths in GB/s)", head]
        for nbytes in sorted({r["nbytes"] for r in result["rows"] if r["kind"] == kind}):
            j, t = by.get(("jax", kind, nbytes)), by.get(("torch", kind, nbytes))
            cell = lambda r: (f"{r['time_s'] * 1e6:>10.1f} {r['algbw'] / 1e9:>7.3f} "  # noqa: E731
                              f"{r['busbw'] / 1e9:>7.3f}" if r else f"{'-':>10} {'-':>7} {'-':>7}")
            q = rat.get((kind, nbytes))
            lines.append(f"{fmt_size(nbytes):>8} {cell(j)} | {cell(t)} | "
                         f"{(f'{q:.2f}' if q else '-'):>15}")
    if result["torch_error"]:
        lines += ["", f"TORCH SIDE FAILED: {result['torch_error']}"]
    if result["handwritten"]:
        ab = result.get("alpha_beta", {})
        fit = (f"launch {ab['launch_s'] * 1e6:.0f} us + steps x alpha {ab['alpha_s'] * 1e6:.1f} "
               f"us + bytes / {ab['bandwidth_Bps'] / 1e9:.3f} GB/s (fitted to JAX ring shifts)"
               if "alpha_s" in ab else ab.get("error", ""))
        lines += ["", f"hand-written all-reduce vs psum; alpha-beta model: {fit}",
                  f"{'size':>8} {'algorithm':>19} {'measured us':>12} {'model us':>10} "
                  f"{'meas/model':>10} {'vs psum':>8}"]
        for r in result["handwritten"]:
            t, p = r["time_s"], r.get("predicted_s")
            model = f"{p * 1e6:.1f}" if p else "-"
            over = f"{t / p:.2f}" if p else "-"
            lines.append(f"{fmt_size(r['nbytes']):>8} {r['algorithm']:>19} {t * 1e6:>12.1f} "
                         f"{model:>10} {over:>10} {r.get('vs_psum', float('nan')):>8.2f}")
    return "\n".join(lines)


def save(result: dict, out: str | Path) -> tuple[Path, Path]:
    """Write `collectives.json` and `collectives.png` into `out`; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "collectives.json"
    js.write_text(json.dumps(dict(result, ratios=ratios(result)), indent=1))
    fig, axs = plt.subplots(1, 3, figsize=(17, 4.8))
    for i, kind in enumerate(result["meta"]["config"]["kinds"]):
        for fw, style in (("jax", "-o"), ("torch", "--s")):
            rows = [r for r in result["rows"] if r["kind"] == kind and r["framework"] == fw]
            if rows:
                axs[0].plot([r["nbytes"] for r in rows], [r["busbw"] / 1e9 for r in rows], style,
                            color=f"C{i}", ms=3, label=f"{kind} {fw}")
        q = [x for x in ratios(result) if x["kind"] == kind]
        if q:
            axs[1].plot([x["nbytes"] for x in q], [x["ratio"] for x in q], "-o", ms=3,
                        color=f"C{i}", label=kind)
    for i, alg in enumerate(dict.fromkeys(r["algorithm"] for r in result["handwritten"])):
        rows = [r for r in result["handwritten"] if r["algorithm"] == alg]
        axs[2].plot([r["nbytes"] for r in rows], [r["time_s"] * 1e6 for r in rows], "o",
                    color=f"C{i}", ms=4, label=f"{alg} measured")
        if "predicted_s" in rows[0]:
            axs[2].plot([r["nbytes"] for r in rows], [r["predicted_s"] * 1e6 for r in rows], "-",
                        color=f"C{i}", lw=1)
    n, plat = result["meta"]["n"], result["meta"]["jax_platform"]
    titles = (f"busbw, {n} {plat} devices (JAX solid, torch dashed)", "JAX / torch busbw",
              "all-reduce: measured (dots) vs alpha-beta model (lines)")
    ylabels = ("GB/s", "ratio", "time (us)")
    for ax, title, yl in zip(axs, titles, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(yl)
        ax.set_title(title, fontsize=10)
        if ax.lines:
            ax.legend(fontsize=6)
    axs[1].axhline(1.0, color="gray", lw=0.8)
    for ax in axs:
        ax.set_yscale("log")
    fig.tight_layout()
    png = out / "collectives.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return js, png


def _parse_bytes(text: str) -> int:
    """1024, 64K, 16M, 1G (KiB, MiB, GiB; a trailing B or iB is allowed) -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": 1024 * MiB}.get(t[-1:], 1)
    number = float(t[:-1] if t[-1:] and t[-1:] in "KMG" else t)   # ValueError: not a size
    if not (number * mult).is_integer():
        raise ValueError(text)
    return int(number * mult)


#: a message size: at least one float32 element
_bytes = arg(parse=_parse_bytes, noun="a size in bytes", lo=4, note="e.g. 1024, 64K, 16M")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxscale bench collectives",
                                description="nccl-tests-style sweep: JAX vs torch.distributed")
    p.add_argument("--min-bytes", type=_bytes, default=1 * KiB)
    p.add_argument("--max-bytes", type=_bytes, default=None,
                   help="default 16M on CPU, 256M on GPU")
    p.add_argument("--factor", type=arg(lo=2), default=4, help="size multiplier between points")
    p.add_argument("--iters", type=arg(lo=1), default=10)
    p.add_argument("--warmup", type=arg(lo=0), default=3)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    p.add_argument("--world", type=arg(lo=1), default=None,
                   help="devices and torch processes (default: all JAX devices, 8 on CPU)")
    p.add_argument("--no-torch", action="store_true", help="JAX side only")
    p.add_argument("--torch-backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--timeout", type=arg(float, above=0), default=180.0,
                   help="seconds allowed for torch start-up and for each torch point")
    p.add_argument("--no-handwritten", action="store_true",
                   help="skip the hand-written all-reduces")
    p.add_argument("--out", default="runs/bench_collectives")
    return p


def _fail(p: argparse.ArgumentParser, msg: str) -> int:
    print(f"{p.prog}: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_bytes is not None and args.max_bytes < args.min_bytes:
        return _fail(p, f"--min-bytes {args.min_bytes} is larger than --max-bytes "
                        f"{args.max_bytes}")
    bad_out = dir_problem(args.out, "--out")     # before the sweep, not after it
    if bad_out:
        return _fail(p, bad_out)
    cfg = SweepConfig(min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=args.factor,
                      iters=args.iters, warmup=args.warmup, world=args.world,
                      kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
                      torch=not args.no_torch, torch_backend=args.torch_backend,
                      timeout=args.timeout, handwritten=not args.no_handwritten)
    try:
        cfg.validate()
    except ValueError as e:
        return _fail(p, str(e))
    simulate_cpu_devices(max(8, args.world or 8))
    try:
        result = run_sweep(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as e:
        return _fail(p, str(e))
    print(format_report(result))
    js, png = save(result, args.out)
    print(f"\nwrote {js} and {png}")
    return 1 if result["torch_error"] else 0


if __name__ == "__main__":
    sys.exit(main())
