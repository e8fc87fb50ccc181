"""python experiments/02_mixed_precision.py [--out runs/exp02] [--steps 60]

Topic 02: mixed precision. The tiny model (2 layers, batch 16 x 64 tokens, dp=8) trains on the
stdlib corpus for `--steps` steps three ways: `plan.precision=fp32`, `bf16` (fp32 master), and
`fp16` (fp32 master, dynamic loss scaling). The 16-bit curves should track fp32 within 0.1 nats.

Underflow: every token's weight (the batch mask) is multiplied by 1e-7. The token-mean loss and its
gradients are unchanged in exact arithmetic (numerator and token count scale together), but the
fp16 backward now carries values around 1e-10, below fp16's smallest subnormal (6e-8), and
flushes them to zero. Measured on one batch (gradients of each parameter group against fp32) and
in training: fp16 with `plan.loss_scale=none` loses its gradients and barely learns; the same
program with the loss scaled by 2^20 recovers the fp32 gradients and trains like fp32.

Communication: the gradient all-reduce over dp, from the census of the step. XLA:CPU has no bf16
reduction and its `all-reduce-promotion` pass widens 16-bit all-reduces to f32 after SPMD
partitioning, so the *compiled* CPU census is the same for fp32 and bf16. The census of the
partitioned program (XLA's dump right after `spmd-partitioning`, with scan trip counts read from
the loop conditions) is what a GPU executes: there the transformer blocks' bf16 gradients move half
the bytes of fp32's. Not every gradient is reduced in 16 bits: the LM head's (its logits matmul
accumulates in f32, so its transpose yields an f32 gradient that is reduced before the cast) and the
RMSNorm scales' (norms compute in f32) are all-reduced in f32; the script lists them and checks the
total against that accounting. Writes mixed_precision.png.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale.analysis import hlo, inspect  # noqa: E402
from jaxscale.data import Batches, load_corpus  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

SEQ, BATCH, DOWN = 64, 16, 1e-7
SCALED = 2.0 ** 20


def grad_all_reduce(text: str, mesh) -> tuple[int, str]:
    """(bytes of the all-reduces per device per step from the census, their element types)."""
    rows = [r for r in inspect.census(text, mesh) if r["kind"] == "all-reduce"]
    types = sorted({dt for ins in hlo.Module(text).instrs
                    if hlo.collective_kind(ins.opcode) == "all-reduce"
                    for dt, dims in hlo.shapes(ins.type_str) if dims})
    return sum(r["bytes"] for r in rows), "+".join(types)


def all_reduce_split(text: str) -> dict:
    """Per-step all-reduce bytes of a partitioned module by (inside the layer scan?, dtype), and
    the shapes of the non-scalar tensors reduced in f32."""
    mod = hlo.Module(text)
    out = {"f32_tensors": []}
    for ins in mod.instrs:
        if hlo.collective_kind(ins.opcode) != "all-reduce":
            continue
        for dt, dims in hlo.shapes(ins.type_str):
            key = ("layers" if ins.computation != mod.entry else "outside", dt)
            out[key] = out.get(key, 0) + hlo.nbytes([(dt, dims)]) * mod.runs[ins.computation]
            if dt == "f32" and dims:
                out["f32_tensors"].append(("layer " if ins.computation != mod.entry else "")
                                          + f"f32{list(dims)}")
    return out


def train(setup, compiled, batches, steps, mask_factor=1.0, scale=None):
    state = setup.init_state()
    if scale is not None:
        ls = jax.device_put(jnp.float32(scale), setup.state_shardings.loss_scale["scale"])
        state = dataclasses.replace(state, loss_scale={**state.loss_scale, "scale": ls})
    sh, rows = setup.batch_shardings(), []
    for i in range(steps):
        b = batches.global_rows(i)
        b["mask"] = b["mask"] * np.float32(mask_factor)
        state, m = compiled(state, {k: jax.device_put(v, sh[k]) for k, v in b.items()})
        rows.append({k: float(v) for k, v in m.items()})
    return rows


def group_grads(precision: str, batch: dict, scales) -> list[dict]:
    setup = build(C.config(*C.DP8, f"plan.precision={precision}", seq=SEQ, batch=BATCH))
    params = setup.init_state().params
    b = {k: jax.device_put(v, setup.batch_shardings()[k]) for k, v in batch.items()}
    f = setup.jit_grads()
    out = []
    for s in scales:
        g = jax.device_get(f(params, b, s)[0])
        out.append({k: np.concatenate([np.ravel(x) for x in jax.tree.leaves(v)])
                    for k, v in g.items()})
    return out


def main():
    args = C.parse_args(__doc__, "runs/exp02",
                        lambda ap: ap.add_argument("--steps", type=int, default=60))
    t0 = time.time()
    claims = C.Claims()
    cfgs = {p: C.config(*C.DP8, f"plan.precision={p}", seq=SEQ, batch=BATCH, steps=args.steps,
                        lr=3e-3) for p in ("fp32", "bf16", "fp16")}
    batches = Batches(load_corpus(cfgs["fp32"].data).train, BATCH, SEQ, seed=0)
    curves, comm, setups, compiled, parts = {}, {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for p, cfg in cfgs.items():
            setups[p] = build(cfg)
            compiled[p], parts[p] = C.compile_partitioned(setups[p], os.path.join(tmp, p))
            part = parts[p]
            comm[p] = {"compiled": grad_all_reduce(compiled[p].as_text(), setups[p].placement.mesh),
                       "partitioned": grad_all_reduce(part, setups[p].placement.mesh)}
            curves[p] = train(setups[p], compiled[p], batches, args.steps)
    # underflow: same fp16 program, mask x 1e-7, loss scale 1 vs 2^20; and the unscaled program
    none = build(C.config(*C.DP8, "plan.precision=fp16", "plan.loss_scale=none", seq=SEQ,
                          batch=BATCH, steps=args.steps, lr=3e-3))
    curves["fp16, no scaling, mask x1e-7"] = train(none, none.train_step, batches, args.steps,
                                                   DOWN)
    curves["fp16, scale 2^20, mask x1e-7"] = train(setups["fp16"], compiled["fp16"], batches,
                                                   args.steps, DOWN, SCALED)

    print(C.table(["step"] + list(curves), [[i] + [f"{curves[k][i]['loss']:.3f}" for k in curves]
                                            for i in range(0, args.steps, 10)] +
                  [[args.steps - 1] + [f"{curves[k][-1]['loss']:.3f}" for k in curves]],
                  title="training loss (nats/token)"))
    base = np.array([r["loss"] for r in curves["fp32"]])
    for p in ("bf16", "fp16"):
        diff = np.abs(np.array([r["loss"] for r in curves[p]]) - base).max()
        claims.check(f"{p} tracks fp32: max |loss diff| over {args.steps} steps", diff, "< 0.1",
                     diff < 0.1)
    claims.check("fp32 trains: first - last loss", base[0] - base[-1], "> 1.0",
                 base[0] - base[-1] > 1.0)
    skipped = int(sum(r["skipped"] for r in curves["fp16"]))
    print(f"fp16 dynamic scaling: {skipped} skipped step(s), final scale "
          f"{curves['fp16'][-1]['loss_scale']:g}")

    b0 = batches.global_rows(0)
    b0["mask"] = b0["mask"] * np.float32(DOWN)
    ref = group_grads("fp32", b0, [1.0])[0]
    unscaled, scaled = group_grads("fp16", b0, [1.0, SCALED])
    rows = []
    for name in ref:
        n = np.linalg.norm(ref[name])
        rows.append([name, f"{n:.3e}",
                     f"{np.linalg.norm(unscaled[name]) / n:.3f}",
                     f"{np.mean(unscaled[name] == 0):.3f}",
                     f"{np.linalg.norm(scaled[name]) / n:.3f}",
                     f"{np.mean(scaled[name] == 0):.3f}"])
    print()
    print(C.table(["params", "fp32 |g|", "fp16 |g|/fp32", "fp16 zeros", "fp16x2^20 |g|/fp32",
                   "fp16x2^20 zeros"], rows,
                  title=f"gradients on one batch with every token weighted {DOWN:g} "
                        "(token-mean gradients equal fp32's in exact arithmetic)"))
    r_un = np.linalg.norm(unscaled["layers"]) / np.linalg.norm(ref["layers"])
    r_sc = np.linalg.norm(scaled["layers"]) / np.linalg.norm(ref["layers"])
    zeros = np.mean(np.concatenate(list(unscaled.values())) == 0)
    claims.check("fp16 without scaling: block gradients |g| / |g fp32|", r_un, "< 0.5",
                 r_un < 0.5)
    claims.check("fp16 without scaling: fraction of gradient elements flushed to 0", zeros,
                 "> 0.9", zeros > 0.9)
    claims.close("fp16 with loss scale 2^20: block gradients |g| / |g fp32|", r_sc, 1.0, 0.05)
    l_none = curves["fp16, no scaling, mask x1e-7"][-1]["loss"]
    l_sc = curves["fp16, scale 2^20, mask x1e-7"][-1]["loss"]
    claims.check("training, mask x1e-7: unscaled fp16 final loss - fp32 final loss",
                 l_none - base[-1], "> 0.5", l_none - base[-1] > 0.5)
    claims.check("training, mask x1e-7: scaled fp16 final loss - fp32 final loss",
                 l_sc - base[-1], "< 0.1", abs(l_sc - base[-1]) < 0.1)

    print()
    print(C.table(["precision", "compiled census (XLA:CPU)", "dtype", "partitioned census",
                   "dtype", "vs fp32 (partitioned)"],
                  [[p, f"{c['compiled'][0]:,}", c["compiled"][1], f"{c['partitioned'][0]:,}",
                    c["partitioned"][1],
                    f"{c['partitioned'][0] / comm['fp32']['partitioned'][0]:.3f}"]
                   for p, c in comm.items()],
                  title="gradient all-reduce bytes per device per step over dp=8 "
                        f"(Psi = {cfgs['fp32'].model.param_count():,} parameters)"))
    psi = cfgs["fp32"].model.param_count()
    claims.close("fp32 gradient all-reduce bytes / 4 Psi", comm["fp32"]["partitioned"][0] / psi,
                 4.0, 0.02)
    sp = {p: all_reduce_split(parts[p]) for p in ("fp32", "bf16")}
    lay = sp["bf16"][("layers", "bf16")] / sp["fp32"][("layers", "f32")]
    claims.close("bf16 / fp32 all-reduce bytes of the block weights' gradients", lay, 0.5, 0.01)
    b16 = sum(v for k, v in sp["bf16"].items() if k[1] == "bf16")
    b32 = sum(v for k, v in sp["bf16"].items() if k[1] == "f32")
    total = comm["bf16"]["partitioned"][0] / comm["fp32"]["partitioned"][0]
    expected = (b16 + b32) / (2 * b16 + b32)        # fp32 carries every element in 4 bytes
    print(f"bf16 program: {b16:,.0f} bytes reduced in bf16, {b32:,.0f} in f32: "
          + ", ".join(sp["bf16"]["f32_tensors"]))
    claims.close("bf16 / fp32 total = (bf16 bytes + f32 bytes) / (2 bf16 + f32)", total,
                 expected, 0.01)
    plt = C.pyplot()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4))
    for k, c in curves.items():
        ax = a1 if "mask" not in k else a2
        ax.plot([r["loss"] for r in c], label=k)
    a2.plot(base, "k:", label="fp32 (mask x1 - same loss)")
    for ax, t in ((a1, "loss curves"), (a2, f"every token weighted {DOWN:g}")):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(t)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    xs = np.arange(len(comm))
    a3.bar(xs - 0.2, [c["compiled"][0] / C.MiB for c in comm.values()], 0.4,
           label="compiled on XLA:CPU (bf16 widened to f32)")
    a3.bar(xs + 0.2, [c["partitioned"][0] / C.MiB for c in comm.values()], 0.4,
           label="partitioned program (as on GPU)")
    a3.set_xticks(xs, list(comm))
    a3.set_ylabel("gradient all-reduce MiB / device / step")
    a3.set_title("gradient communication")
    a3.legend(fontsize=8)
    C.save(fig, args.out, "mixed_precision.png")
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {"curves": curves, "comm": comm})


if __name__ == "__main__":
    main()
