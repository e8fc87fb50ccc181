"""Collectives sweep in the style of nccl-tests: JAX shard_map collectives vs torch.distributed.

    python -m jaxscale.comm.bench [--min-bytes 1024 --max-bytes 16M --factor 4 --iters 10]
    jaxscale bench collectives ...         (same arguments)

`jaxscale.comm.bench_sweep` runs the sweep (the JAX side: `jaxscale.comm.jax_bench`; the torch
side: `jaxscale.comm.torch_bench`). This module is its command line (`main`) and its report: per
kind and size the time, algbw and busbw of JAX and of torch, and the JAX/torch busbw ratio
reported per size (`ratios`, `format_report`); the hand-written all-reduces against `psum` beside
their alpha-beta prediction; the plots (`save`).

Simulated CPU devices: `main` sets `XLA_FLAGS=--xla_force_host_platform_device_count=max(8,
world)` when jax is not yet imported and the flag is absent. They share the host's cores, so
absolute CPU figures mean little; the JAX/torch ratio measured in one run is the result.
Outputs: a printed table, `collectives.json` and `collectives.png` under `--out`. Exit status: 0;
1 if the torch side failed (the JAX results are still printed and saved); 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxscale.comm.bench_sweep import KiB, MiB, SweepConfig, run_sweep
from jaxscale.comm.torch_bench import KINDS
from jaxscale.cost import busbw_factor
from jaxscale.fields import arg, dir_problem
from jaxscale.hardware import simulate_cpu_devices


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
