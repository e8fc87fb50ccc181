"""Experiment 25: sparse training: sparse attention (FLOPs skipped by the tile map against
mask density), pruning and distillation during training, sparse embedding-gradient exchange.

Run (CPU; `--part attention` or `--part training` for one half; measured on a shared 2-core
machine: part 1 about 80 s of CPU, part 2 176 s):

    python experiments/25_sparse_attention.py --out runs/exp25

Part 1, sparse attention.
For causal, sliding-window, local+global block-sparse and random block-sparse masks at T=8192
(H=8, D=128), count the (query block, key block) tiles the Pallas kernel's forward visits
(`TileMap`, block 128 x 64) against the dense count: kernel FLOPs = visited tiles x
4·bq·bk·D·H, the dense figure 4·T²·D·H (FlashAttention's FLOP formula). The ideal saving is
1 - density (density = allowed (query, key) pairs / T²); the gap is the partial tiles on the mask's
edges. The xla reference's `cost_analysis()` counts the dense FLOPs whatever the mask (it computes
every score, then masks); `blockwise`'s counts a loop body once (XLA cannot know data-dependent
trip counts), so the work it skips is measured instead as CPU forward time relative to its dense
run at T=2048, H=4, D=64, tiles 128x128 (ratios within one run; absolute CPU times mean
nothing), beside the fraction of its own tiles it visits; the dense row, timed against itself,
shows how noisy the timing is on a shared machine. Writes a table, JSON and sparse.png to --out.

Part 2, sparse training (tiny LLaMA, 2 layers, dim 128, byte vocabulary 320, dp=8, the
framework's own train step on the stdlib corpus):
pruning during training (`plan.prune`) at 0, 50 % and 75 % magnitude (cubic ramp from update
PRUNE_START to PRUNE_END) and 2:4, the same batches: the loss on unseen batches (the mean of
the last 10 steps, each batch taken before its update) and the measured sparsity;
the sparse embedding-gradient exchange (`plan.sparse_embedding`) against the dense all-reduce,
bytes from the compiled step's collective census beside the formula; distillation of a smaller
student (1 layer, dim 64) from the unpruned run as teacher
(`train.teacher`), with and without the KL term. Writes sparse_training.json and
exp25_sparse_training.png under --out (and where --figure says).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

C.cpu_only()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale.kernels.blockwise import blockwise_attention  # noqa: E402
from jaxscale.kernels.flash_attention import visited_tiles  # noqa: E402
from jaxscale.kernels.reference import reference_attention  # noqa: E402
from jaxscale.kernels.tiles import BlockSparseMask, tile_map  # noqa: E402


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


def attention_part(args):
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
            sch = tile_map(Tt, Tt, 128, 128, causal=causal, window=window, block_mask=bm_t)
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


# =============================================================================== part 2
STEPS, STUDENT_STEPS, LAST = 40, 40, 10
PRUNE_START, PRUNE_END = 5, 20
PRUNE = {"dense": (), "magnitude 50%": ("plan.prune=magnitude", "plan.prune_sparsity=0.5"),
         "2:4": ("plan.prune=2:4",),
         "magnitude 75%": ("plan.prune=magnitude", "plan.prune_sparsity=0.75")}
RAMP = (f"plan.prune_start={PRUNE_START}", f"plan.prune_end={PRUNE_END}")
STUDENT = ("model.n_layers=1", "model.dim=64", "model.ffn_dim=192", "model.n_heads=4",
           "model.n_kv_heads=2")


def _train(cfg, steps, train_b, exe=None):
    """(setup, compiled step, final state, train losses, mean CE of the last LAST steps, metrics
    rows). Batch i is seen once, and its loss is taken before the update on it: the last steps'
    mean is a held-out estimate without an eval step to compile."""
    from jaxscale.train.setup import build
    s = build(cfg)
    exe = exe or s.lower_train_step().compile()
    fn = exe if s.teacher is None else (lambda st, b: exe(st, b, s.teacher.params))
    state, rows = s.init_state(), []
    with jax.set_mesh(s.placement.mesh):
        for i in range(steps):
            state, m = fn(state, train_b.device_batch(i, s.batch_shardings()))
            rows.append({k: float(v) for k, v in jax.device_get(m).items()})
    losses = [r["loss"] for r in rows]
    return s, exe, state, losses, float(np.mean(losses[-LAST:])), rows


def _zeros(s, params) -> float:
    from jax.sharding import PartitionSpec as P

    from jaxscale.strategies.prune import is_pruned
    leaves = [np.asarray(w) for (path, w), n in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(s.model.logical, is_leaf=lambda x: isinstance(x, P))) if is_pruned(path, n)]
    return float(sum(int((w == 0).sum()) for w in leaves) / sum(w.size for w in leaves))


def _census(s, exe):
    from jaxscale.analysis import inspect
    return inspect.census(exe.as_text(), s.placement.mesh)


def _save_teacher(s, state, out) -> str:
    """A run directory as `jaxscale train` writes it (config.json, checkpoints/<step>)."""
    import shutil
    from pathlib import Path

    from jaxscale import config as config_lib
    from jaxscale.train import checkpoint as ckpt_lib
    from jaxscale.train import checkpoint_meta as ckpt_meta
    d = Path(out) / "teacher"
    shutil.rmtree(d, ignore_errors=True)
    ck = ckpt_lib.Checkpointer(d / "checkpoints", config_lib.CheckpointConfig(async_save=False))
    ck.save(STEPS, state, ckpt_meta.make_meta(s.cfg, state, STEPS))
    ck.wait()
    ck.close()
    config_lib.save(s.cfg, d / "config.json")
    return str(d)


def training_part(out, figure):
    from jaxscale.data import make_batches
    from jaxscale.strategies import sparse_embedding as SE
    t0 = time.time()
    base = C.config(*C.DP8, steps=STEPS, lr=3e-3)
    train_b, _ = make_batches(base.data)
    res = {"prune": {}, "embedding": [], "distill": {}}

    # --- pruning during training, and the dense run kept as the teacher
    teacher_dir = None
    for name, over in PRUNE.items():
        cfg = C.apply_overrides(base, list(over + (RAMP if "magnitude" in name else
                                                   RAMP[:1] if over else ())))
        s, exe, state, losses, ev, _ = _train(cfg, STEPS, train_b)
        res["prune"][name] = {"losses": losses, "eval": ev, "zeros": _zeros(s, state.params)}
        if name == "dense":
            dense = (s, exe, losses)
            teacher_dir = _save_teacher(s, state, out)
    rows = [[n, f"{r['zeros']:.1%}", f"{r['losses'][-1]:.3f}", f"{r['eval']:.3f}"]
            for n, r in res["prune"].items()]
    print(C.table(["pruning", "zeros in block weights", "train CE (last step)",
                   f"CE, last {LAST} steps"],
                  rows, title=f"\npruning during training ({STEPS} steps, masks from update "
                              f"{PRUNE_START}; magnitude ramp to update {PRUNE_END})"))

    # --- sparse vs dense embedding exchange: bytes from the compiled step's census
    from jaxscale.train.setup import build
    s = build(C.apply_overrides(base, ["plan.sparse_embedding=true"]))
    exe = s.lower_train_step().compile()      # (equal losses: tests/test_sparse_training.py)
    runs = [("320", dense[0], dense[1], s, exe)]
    big = [C.apply_overrides(base, ["model.vocab_size=4096"] + x)
           for x in ([], ["plan.sparse_embedding=true"])]
    bd, bs = build(big[0]), build(big[1])
    runs.append(("4096", bd, bd.lower_train_step().compile(), bs, bs.lower_train_step().compile()))
    for vocab, sd, ed, ss, es in runs:
        cd, cs = _census(sd, ed), _census(ss, es)
        ar = lambda c: sum(r["bytes"] for r in c if r["kind"] == "all-reduce")    # noqa: E731
        gather = sum(r["bytes"] for r in cs if r["kind"] == "all-gather")
        spec = ss.placement.spec
        n, R, D = spec.deg("dp"), SE.rows(spec), spec.model.dim
        res["embedding"].append({
            "vocab": int(vocab), "rows_per_device": R, "dense_embedding_allreduce":
            ar(cd) - ar(cs) + 4, "formula_dense": SE.dense_bytes(spec), "sparse_allgather": gather,
            "formula_sparse": 4 * n * R * (D + 1), "dense_total": sum(r["bytes"] for r in cd),
            "sparse_total": sum(r["bytes"] for r in cs),
            "dense_wire": sum(r["wire_bytes"] for r in cd),
            "sparse_wire": sum(r["wire_bytes"] for r in cs)})
    print(C.table(["vocab", "rows R/device", "dense emb. all-reduce B", "formula 4VD",
                   "sparse all-gathers B", "formula 4NR(D+1)", "step total dense",
                   "step total sparse", "link bytes dense", "link bytes sparse"],
                  [[str(e["vocab"]), e["rows_per_device"], e["dense_embedding_allreduce"],
                    e["formula_dense"], e["sparse_allgather"], e["formula_sparse"],
                    e["dense_total"], e["sparse_total"], e["dense_wire"], e["sparse_wire"]]
                   for e in res["embedding"]],
                  title="\nembedding-gradient exchange over dp=8 (collective census of the step, "
                        "bytes per device)"))

    # --- distillation: a smaller student with and without the teacher
    for name, over in (("student, CE only", []),
                       ("student, KD a=0.5 T=1", [f"train.teacher={teacher_dir}",
                                                  "train.distill_alpha=0.5",
                                                  "train.distill_temperature=1"])):
        cfg = C.apply_overrides(base, list(STUDENT) + over + [f"train.steps={STUDENT_STEPS}"])
        s, _, _, losses, ev, rows = _train(cfg, STUDENT_STEPS, train_b)
        res["distill"][name] = {"losses": losses, "eval": ev,
                                "kd": [r.get("distill_kd") for r in rows],
                                "params": s.model.cfg.param_count()}
    res["distill"]["teacher"] = {"eval": res["prune"]["dense"]["eval"],
                                 "params": dense[0].model.cfg.param_count()}
    print(C.table(["model", "parameters", f"CE, last {LAST} steps"],
                  [[n, r["params"], f"{r['eval']:.3f}"] for n, r in res["distill"].items()],
                  title=f"\ndistillation ({STUDENT_STEPS} steps, same batches)"))
    res["seconds"] = time.time() - t0
    with open(os.path.join(out, "sparse_training.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    _plot_training(res, [os.path.join(out, "exp25_sparse_training.png")] + ([figure] if figure
                                                                            else []))
    print(f"part 2: {res['seconds']:.0f} s; wrote {out}/sparse_training.json")


def _plot_training(res, paths):
    plt = C.pyplot()
    fig, axs = plt.subplots(1, 3, figsize=(14, 4.2))
    smooth = lambda x: np.convolve(x, np.ones(5) / 5, mode="valid")  # noqa: E731
    for name, r in res["prune"].items():
        axs[0].plot(smooth(r["losses"]), label=f"{name}: last-{LAST} CE {r['eval']:.3f}")
    axs[0].axvspan(PRUNE_START, PRUNE_END, color="grey", alpha=0.15, label="magnitude ramp")
    axs[0].set(xlabel="step", ylabel="train CE (5-step mean)", title="pruning during training")
    axs[0].legend(fontsize=7)
    emb = res["embedding"]
    x = np.arange(len(emb))
    axs[1].bar(x - 0.2, [e["dense_embedding_allreduce"] / 1e3 for e in emb], 0.4,
               label="dense all-reduce 4VD")
    axs[1].bar(x + 0.2, [e["sparse_allgather"] / 1e3 for e in emb], 0.4,
               label="sparse: all-gather ids + rows")
    axs[1].set_xticks(x, [f"vocab {e['vocab']}\nR={e['rows_per_device']}" for e in emb])
    axs[1].set(ylabel="KB per device per step (census)", title="embedding-gradient exchange")
    axs[1].set_yscale("log")
    axs[1].legend(fontsize=7)
    for name, r in res["distill"].items():
        if "losses" in r:
            axs[2].plot(smooth(r["losses"]), label=f"{name}: last-{LAST} CE {r['eval']:.3f}")
    axs[2].axhline(res["distill"]["teacher"]["eval"], color="k", ls="--", lw=1,
                   label="teacher (last-10 CE)")
    axs[2].set(xlabel="step", ylabel="student train CE", title="distillation")
    axs[2].legend(fontsize=7)
    fig.tight_layout()
    for p in paths:
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        fig.savefig(p, dpi=110)
        print(f"wrote {p}")
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/exp25")
    ap.add_argument("--part", choices=("all", "attention", "training"), default="all")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--time-seq", type=int, default=2048)
    ap.add_argument("--no-time", action="store_true", help="skip the CPU timing column")
    ap.add_argument("--figure", default=None, help="also copy the sparse-training figure here "
                    "(docs/img/exp25_sparse_training.png)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.part in ("all", "attention"):
        attention_part(args)
    if args.part in ("all", "training"):
        training_part(args.out, args.figure)


if __name__ == "__main__":
    main()
