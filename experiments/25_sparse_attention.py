"""Experiment 25: sparse attention, FLOPs skipped by the tile schedule against mask density.

Run (CPU, about a minute):

    python experiments/25_sparse_attention.py --out runs/exp25

For causal, sliding-window, local+global block-sparse and random block-sparse masks at T=8192
(H=8, D=128), count the (query block, key block) tiles the Pallas kernel's forward visits
(`TileSchedule`, block 128 x 64) against the dense count: kernel FLOPs = visited tiles x
4·bq·bk·D·H, the dense figure 4·T²·D·H (FlashAttention's FLOP formula). The ideal saving is
1 - density (density = allowed (query, key) pairs / T²); the gap is the partial tiles on the mask's
edges. The xla reference's `cost_analysis()` counts the dense FLOPs whatever the mask (it computes
every score, then masks); `blockwise`'s counts a loop body once (XLA cannot know data-dependent
trip counts), so the work it skips is measured instead as CPU forward time relative to its dense
run at T=2048, H=4, D=64, tiles 128x128 (ratios within one run; absolute CPU times mean
nothing), beside the fraction of its own tiles it visits; the dense row, timed against itself,
shows how noisy the timing is on a shared machine. Writes a table, JSON and
sparse.png to --out.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale.kernels.blockwise import (BlockSparseMask, blockwise_attention,  # noqa: E402
                                        tile_schedule)
from jaxscale.kernels.flash_attention import visited_tiles  # noqa: E402
from jaxscale.kernels.reference import reference_attention  # noqa: E402


def masks(T: int, blk: int):
    """(name, causal, window, block_mask) for the sweep, mask blocks of `blk`."""
    n = T // blk
    out = [("dense", False, None, None), ("causal", True, None, None)]
    for w in (128, 512, 1024, 2048, 4096):
        out.append((f"causal window {w}", True, w, None))
    for width in (1, 2, 4, 8, 16):
        out.append((f"local {width} + 1 global blocks", True, None,
                    BlockSparseMask.local(n, n, width, blk, blk, causal=True, global_blocks=1)))
    rng = np.random.default_rng(0)
    for p in (0.1, 0.25, 0.5, 0.75):
        bm = rng.random((n, n)) < p
        np.fill_diagonal(bm, True)
        out.append((f"random blocks p={p}", False, None, BlockSparseMask.from_array(bm, blk, blk)))
    return out


def density(T, causal, window, bm) -> float:
    d = np.arange(T)[:, None] - np.arange(T)[None, :]
    m = np.ones((T, T), bool)
    if causal:
        m &= d >= 0
    if window is not None:
        m &= d < window
    if bm is not None:
        m &= bm.dense(T, T)
    return float(m.mean())


def _blockwise_fn(T, causal, window, bm):
    return jax.jit(functools.partial(blockwise_attention, causal=causal, window=window,
                                     block_mask=bm, block_q=128, block_k=128))


def time_vs_dense(T, causal, window, bm, H=4, D=64, reps=7) -> float:
    """min time of the masked forward / min time of the dense one, the two runs interleaved so
    that both see the same load on a shared machine."""
    q = jax.random.normal(jax.random.PRNGKey(0), (1, T, H, D), jnp.float32)
    fns = [_blockwise_fn(T, False, None, None), _blockwise_fn(T, causal, window, bm)]
    times = [[], []]
    for f in fns:
        f(q, q, q).block_until_ready()
    for _ in range(reps):
        for f, ts in zip(fns, times):
            t0 = time.perf_counter()
            f(q, q, q).block_until_ready()
            ts.append(time.perf_counter() - t0)
    return min(times[1]) / min(times[0])


def xla_flops(T, H, D, causal) -> float:
    x = jax.ShapeDtypeStruct((1, T, H, D), jnp.float32)
    f = functools.partial(reference_attention, causal=causal)
    return float(jax.jit(f).lower(x, x, x).compile().cost_analysis()["flops"])


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    kinds = {"window": "o", "local": "s", "random": "^", "causal": "D", "dense": "x"}
    for kind, marker in kinds.items():
        pts = [(r["density"], r["skipped"]) for r in rows if kind in r["mask"]
               and not (kind == "causal" and "window" in r["mask"])]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=kind)
    ax.plot([0, 1], [1, 0], "k--", lw=1, label="ideal: 1 - density")
    timed = [(r["time_seq_density"], 1 - r["time_vs_dense"]) for r in rows
             if r.get("time_vs_dense")]
    if timed:
        ax.scatter(*zip(*timed), marker="+", color="grey", s=60,
                   label="blockwise CPU time saved (T=2048, its density)")
    ax.set_xlabel("mask density (allowed pairs / T²)")
    ax.set_ylabel("fraction of attention FLOPs skipped")
    ax.set_title("tile skipping, T=8192, tiles 128x64")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/exp25")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--time-seq", type=int, default=2048)
    ap.add_argument("--no-time", action="store_true", help="skip the CPU timing column")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    T, H, D = args.seq, 8, 128

    rows = []
    for name, causal, window, bm in masks(T, 128):
        vt = visited_tiles(T, T, causal=causal, window=window, block_mask=bm)
        per_tile = 4 * vt["block_q"] * vt["block_k"] * D * H
        row = {"mask": name, "density": density(T, causal, window, bm),
               "tiles_visited": vt["visited"], "tiles_full": vt["full"],
               "tiles_dense": vt["dense"], "kernel_gflops": vt["visited"] * per_tile / 1e9,
               "dense_gflops": 4 * T * T * D * H / 1e9}
        row["skipped"] = 1 - vt["visited"] / vt["dense"]
        if not args.no_time:  # same mask family at the timing length
            Tt = args.time_seq
            bm_t = None
            if bm is not None:
                a = bm.array()[: Tt // 128, : Tt // 128]
                bm_t = BlockSparseMask.from_array(a, 128, 128)
            row["time_vs_dense"] = time_vs_dense(Tt, causal, window, bm_t)
            row["time_seq_density"] = density(Tt, causal, window, bm_t)
            sch = tile_schedule(Tt, Tt, 128, 128, causal=causal, window=window, block_mask=bm_t)
            row["time_seq_tiles_ratio"] = sch.visited / sch.dense   # blockwise's own tiles
        rows.append(row)

    xla_dense, xla_causal = xla_flops(2048, H, D, False), xla_flops(2048, H, D, True)
    lines = ["| mask | density | tiles visited / dense | kernel GFLOP (fwd) | FLOPs skipped | "
             "ideal 1-density | blockwise CPU time vs dense (T=%d) |" % args.time_seq,
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tv = r.get("time_vs_dense")
        timed = "-" if tv is None else f"{tv:.2f} (tiles {r['time_seq_tiles_ratio']:.2f})"
        lines.append(f"| {r['mask']} | {r['density']:.3f} | {r['tiles_visited']}/{r['tiles_dense']}"
                     f" | {r['kernel_gflops']:.1f} | {r['skipped']:.1%} | {1 - r['density']:.1%} | "
                     f"{timed} |")
    lines += ["", f"xla reference cost_analysis() at T=2048: dense {xla_dense / 1e9:.1f} GFLOP, "
              f"causal {xla_causal / 1e9:.1f} GFLOP (the mask saves nothing: every score is "
              f"computed); formula 4·T²·D·H = {4 * 2048 ** 2 * D * H / 1e9:.1f} GFLOP"]
    table = "\n".join(lines)
    print(table)
    plot(rows, os.path.join(args.out, "sparse.png"))
    with open(os.path.join(args.out, "table.md"), "w") as fh:
        fh.write(table + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"T": T, "H": H, "D": D, "rows": rows, "xla_cost_flops_T2048":
                   {"dense": xla_dense, "causal": xla_causal}}, fh, indent=1)
    print(f"\nwrote {args.out}/sparse.png, table.md, results.json")


if __name__ == "__main__":
    main()
