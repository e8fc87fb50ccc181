"""python experiments/10_collectives.py [--out runs/10_collectives] [--quick] [--no-torch]

Topic 10: collectives. Three parts, all in one run:
1. An nccl-tests-style sweep (1 KiB to 16 MiB on CPU) of all-reduce, all-gather, reduce-scatter,
   all-to-all, broadcast and permute, JAX shard_map collectives against a torch.distributed job
   (gloo on CPU) of the same 8 ranks, alternating per size; busbw table and JAX/torch ratios.
2. The hand-written all-reduces of `jaxscale.comm.algorithms` (ring, recursive halving-doubling,
   recursive doubling, two-level hierarchical on 2 simulated nodes of 4 devices) against psum,
   beside the alpha-beta model (`jaxscale.comm.algorithm_cost`) calibrated on measured ring
   shifts.
3. From the model: a two-level hierarchy against a flat ring when the inter-node link is slower,
   nodes being groups of devices (2x4 = the 8 simulated devices, 4x8, 16x8), with per-device
   links of an H100 node: NVLink 450 GB/s and 5 us, one 400 Gb/s NIC per GPU, 50 GB/s and 15 us.
Simulated CPU devices share two cores: absolute CPU figures mean little, ratios measured side by
side are the result. Under three minutes on 2 cores (--quick: about 30 s). Writes
collectives.json, collectives.png and hierarchy_model.png under --out.
"""
from __future__ import annotations

import argparse
import sys

import _common  # noqa: F401  first: 8 simulated devices before jax is imported

from jaxscale.comm import algorithm_cost as C
from jaxscale.comm import bench, bench_sweep

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
INTRA = C.Link(alpha=5e-6, bandwidth=450e9)   # NVLink, per device
INTER = C.Link(alpha=15e-6, bandwidth=50e9)   # 400 Gb/s NIC per GPU
LAYOUTS = ((2, 4), (4, 8), (16, 8))           # (nodes, devices per node)


def ratio_table(result: dict) -> str:
    rat = {(q["kind"], q["nbytes"]): q["ratio"] for q in bench.ratios(result)}
    kinds = result["meta"]["config"]["kinds"]
    lines = ["JAX / torch busbw, per size (>1: JAX faster)",
             f"{'size':>8} " + " ".join(f"{k:>14}" for k in kinds)]
    for s in sorted({n for _, n in rat}):
        cells = [f"{rat[k, s]:>14.2f}" if (k, s) in rat else f"{'-':>14}" for k in kinds]
        lines.append(f"{bench.fmt_size(s):>8} " + " ".join(cells))
    return "\n".join(lines)


def handwritten_summary(result: dict) -> str:
    rows = result["handwritten"]
    algs = list(dict.fromkeys(r["algorithm"] for r in rows if r["algorithm"] != "psum"))
    by = {(r["algorithm"], r["nbytes"]): r for r in rows}
    lines = ["hand-written all-reduce: time / psum time (measured/model in brackets)",
             f"{'size':>8} " + " ".join(f"{a:>24}" for a in algs)]
    for s in sorted({r["nbytes"] for r in rows}):
        cells = []
        for a in algs:
            r = by.get((a, s))
            if r is None:
                cells.append(f"{'-':>24}")
                continue
            model = f"({r['time_s'] / r['predicted_s']:.2f})" if r.get("predicted_s") else ""
            cells.append(f"{r['vs_psum']:>16.2f} {model:>7}")
        lines.append(f"{bench.fmt_size(s):>8} " + " ".join(cells))
    return "\n".join(lines)


def hierarchy_demo() -> tuple[str, dict]:
    sizes = [64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB]
    lines = ["two-level all-reduce vs flat ring, alpha-beta model; intra "
             f"{INTRA.bandwidth / 1e9:.0f} GB/s {INTRA.alpha * 1e6:.0f} us, "
             f"inter {INTER.bandwidth / 1e9:.0f} GB/s {INTER.alpha * 1e6:.0f} us per device",
             f"{'nodes x per-node':>16} {'size':>8} {'flat ring us':>13} {'two-level us':>13} "
             f"{'speedup':>8} {'busiest inter-node link bytes, flat / two-level':>48}"]
    curves: dict = {"sizes": sizes, "layouts": {}, "bw_ratio": {}}
    for b, a in LAYOUTS:
        flat = [C.flat_ring_time(s, a, b, INTRA, INTER) for s in sizes]
        hier = [C.hierarchical_time(s, a, b, INTRA, INTER) for s in sizes]
        curves["layouts"][f"{b}x{a}"] = (flat, hier)
        n = a * b
        for s, f, h in zip(sizes, flat, hier):
            # flat ring: each boundary link carries S/N on each of 2(N-1) steps; two-level:
            # each device's NIC carries its outer ring all-reduce of S/a
            inter_flat, inter_hier = 2 * (n - 1) / n * s, 2 * (b - 1) / (a * b) * s
            lines.append(f"{f'{b} x {a}':>16} {bench.fmt_size(s):>8} {f * 1e6:>13.1f} "
                         f"{h * 1e6:>13.1f} {f / h:>8.2f} {inter_flat / inter_hier:>48.1f}")
    lines += ["", "speedup of the two-level all-reduce at 256 MiB vs inter/intra bandwidth ratio",
              f"{'inter/intra':>12} " + " ".join(f"{f'{b}x{a}':>8}" for b, a in LAYOUTS)]
    for frac in (1, 1 / 2, 1 / 4, 1 / 9, 1 / 16, 1 / 32):
        inter = C.Link(INTER.alpha, INTRA.bandwidth * frac)
        sp = [C.flat_ring_time(256 * MiB, a, b, INTRA, inter) /
              C.hierarchical_time(256 * MiB, a, b, INTRA, inter) for b, a in LAYOUTS]
        curves["bw_ratio"][frac] = sp
        lines.append(f"{frac:>12.3f} " + " ".join(f"{x:>8.2f}" for x in sp))
    return "\n".join(lines), curves


def plot_hierarchy(curves: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, (flat, hier)) in enumerate(curves["layouts"].items()):
        ax0.plot(curves["sizes"], [t * 1e6 for t in flat], "--", color=f"C{i}",
                 label=f"flat ring {name}")
        ax0.plot(curves["sizes"], [t * 1e6 for t in hier], "-o", ms=3, color=f"C{i}",
                 label=f"two-level {name}")
    ax0.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="time (us)",
            title="all-reduce, alpha-beta model (nodes x devices per node)")
    fracs = sorted(curves["bw_ratio"])
    for i, (b, a) in enumerate(LAYOUTS):
        ax1.plot(fracs, [curves["bw_ratio"][f][i] for f in fracs], "-o", ms=3, label=f"{b}x{a}")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(xscale="log", xlabel="inter-node / intra-node bandwidth",
            ylabel="flat ring time / two-level time", title="speedup at 256 MiB")
    for ax in (ax0, ax1):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/10_collectives")
    p.add_argument("--quick", action="store_true", help="1 KiB..1 MiB, 5 iterations")
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args(argv)
    cfg = bench_sweep.SweepConfig(min_bytes=1 * KiB, max_bytes=(1 if args.quick else 16) * MiB,
                                  factor=4, iters=5 if args.quick else 10,
                                  warmup=2 if args.quick else 3, world=8, torch=not args.no_torch)
    result = bench_sweep.run_sweep(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(bench.format_report(result))
    print()
    print(ratio_table(result))
    print()
    print(handwritten_summary(result))
    print()
    demo, curves = hierarchy_demo()
    print(demo)
    js, png = bench.save(result, args.out)
    model_png = png.parent / "hierarchy_model.png"
    plot_hierarchy(curves, model_png)
    print(f"\nwrote {js}, {png} and {model_png}")
    if result["torch_error"]:
        print(f"\nthe torch side failed: {result['torch_error']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
