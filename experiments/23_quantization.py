"""python experiments/23_quantization.py [--out runs/exp23]
                                         [--figure docs/img/exp23_compression.png]

Topic 23: compression of a trained model with `jaxscale.strategies.qat.ptq`: quantisation, pruning,
distillation. Tiny LLaMA (4 layers, dim 128, byte vocabulary 320), trained for TEACHER_STEPS
steps by the framework's own train step (`build(cfg).train_step`, dp=8, AdamW) on the stdlib
corpus; every loss below is the token-mean cross entropy on the same held-out batches.

1. Weight-only post-training quantisation (per output channel, symmetric): fp32, int8, int6,
   int4. Weight bytes as stored (int6 held in int8 bytes; int4 packed two per byte) and as
   ideally packed, the held-out loss, and the largest logit error relative to the largest logit.
   Also: QAT, FT_STEPS steps of fine-tuning through int4 fake quantisation (straight-through
   gradient), against the same steps of plain fine-tuning followed by int4 PTQ.
2. Pruning: per-matrix magnitude masks at 0 / 25 / 50 / 75 % and 2:4 (along the contracted input
   axis): loss right after pruning and after FT_STEPS fine-tuning steps that keep the mask
   (gradients masked, weights re-masked after each Adam step). 0 % fine-tuned for the same steps
   is the baseline. The embedding table is not pruned (a lookup, not a matmul).
3. Distillation: a 2-layer student trained KD_STEPS steps from the same initialisation with
   plain cross entropy and with alpha T^2 KL(teacher || student) + (1 - alpha) CE at T = 1 and
   T = 2, equal steps, batches and learning rate; its held-out CE and KL to the teacher (T = 1).
4. Quantisation-aware training as a plan option (`plan.qat`, jaxscale/strategies/qat/): the
   teacher's run again for QAT_STEPS steps with plan.qat=int8 and plan.qat=fp8 (delayed
   scaling, 16-step amax history), same initialisation, batches and schedule as the fp32 run
   (whose first QAT_STEPS losses are the teacher's): loss curves, held-out loss through each
   plan's own quantised forward, the dots of the compiled steps by operand dtype, and compiled
   memory per device against the planner's terms.
Writes results.json and compression.png under --out. About 2.5 minutes on 2 cores.
"""
from __future__ import annotations

import dataclasses
import shutil
import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

C.cpu_only()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from jaxscale.data import Batches, load_corpus  # noqa: E402
from jaxscale.strategies.prune import masks as M  # noqa: E402
from jaxscale.strategies.qat import ptq as Q  # noqa: E402
from jaxscale.strategies.tables.params import contracted_axes  # noqa: E402
from jaxscale.train import distill as distill_lib  # noqa: E402
from jaxscale.train.grads import token_loss  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402
from jaxscale.train.state import FunctionalModel  # noqa: E402

SEQ, BATCH, EVAL_ROWS = 64, 16, 128
TEACHER_STEPS, FT_STEPS, KD_STEPS, QAT_STEPS = 150, 30, 100, 60
FT_LR, KD_LR = 5e-4, 3e-3
KD = {"CE only": None, "KD alpha=0.5 T=1": (0.5, 1.0), "KD alpha=0.5 T=2": (0.5, 2.0)}
SPARSITIES = (0.0, 0.25, 0.5, 0.75)


def train_run(cfg, train, steps, keep=None, initial=None):
    """`steps` steps of the framework's train step, lowered and compiled once. Returns a dict:
    setup, lowered, step (compiled), params (final, on the host), curve (losses), initial (the
    state before the first step, on the host), kept (the parameters after `keep` steps).
    `initial`: start from this host state (another plan's: same parameters and moments)."""
    from jaxscale.strategies import qat
    s = build(cfg)
    lowered = s.lower_train_step()
    step = lowered.compile()
    if initial is None:
        state = s.init_state()
        initial = jax.device_get(state)
    else:                   # the same start; a fresh fp8 amax history when the plan has one
        fresh = qat.init_state(s.placement.spec)
        state = jax.device_put(dataclasses.replace(initial, quant=fresh), s.state_shardings)
    losses, kept = [], None
    for i in range(steps):
        state, m = step(state, train.device_batch(i, s.batch_shardings()))
        losses.append(float(m["loss"]))
        if i + 1 == keep:
            kept = jax.device_get(state.params)
    return {"setup": s, "lowered": lowered, "step": step, "params": jax.device_get(state.params),
            "curve": losses, "initial": initial, "kept": kept}


def mean_loss(model, params, rows):
    total, n = token_loss(model.apply(params, rows["inputs"]), rows["targets"], rows["mask"])
    return total / n


def finetune_step(model, lr, qat_bits=None):
    """A jitted Adam step on one device that keeps `masks` (gradients and weights masked; None
    leaves are free) and, with `qat_bits`, trains through fake quantisation (STE)."""
    opt = optax.adam(lr)

    def loss(p, b):
        return mean_loss(model, Q.fake_quantize(p, model.logical, qat_bits) if qat_bits else p, b)

    @jax.jit
    def step(p, o, b, mk):
        val, g = jax.value_and_grad(loss)(p, b)
        u, o = opt.update(M.apply(g, mk), o, p)
        return M.apply(optax.apply_updates(p, u), mk), o, val
    return step, opt


def finetune(step_opt, params, train, masks=None):
    step, opt = step_opt
    masks = masks if masks is not None else jax.tree.map(lambda _: None, params)
    p, o = M.apply(params, masks), opt.init(params)
    for i in range(FT_STEPS):
        p, o, _ = step(p, o, train.global_rows(10_000 + i), masks)
    return p


def distill_step(student, teacher, t_params, kd: bool):
    """A jitted Adam step of the student: plain CE, or alpha KD + (1 - alpha) CE at T."""
    opt = optax.adam(optax.warmup_cosine_decay_schedule(0.0, KD_LR, 10, KD_STEPS, KD_LR / 10))

    @jax.jit
    def step(p, o, b, alpha, temperature):
        def loss(p):
            logits = student.apply(p, b["inputs"])
            if not kd:
                total, n = token_loss(logits, b["targets"], b["mask"])
                return total / n
            t_logits = teacher.apply(t_params, b["inputs"])
            return distill_lib.objective(logits, t_logits, b["targets"], b["mask"], alpha,
                                       temperature)[0]
        val, g = jax.value_and_grad(loss)(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, val
    return step, opt


def distill(step_opt, s_params, train, alpha=1.0, temperature=1.0):
    step, opt = step_opt
    p, o = s_params, opt.init(s_params)
    for i in range(KD_STEPS):
        p, o, _ = step(p, o, train.global_rows(20_000 + i), alpha, temperature)
    return p


def dot_dtypes(text: str) -> dict:
    """'lhs x rhs -> out' dtypes of every dot of an HLO module, times its loop trip counts."""
    from jaxscale.analysis import hlo
    mod, out = hlo.Module(text), {}
    for ins in mod.instrs:
        if ins.opcode == "dot":
            ops = [o[0][0] for o in mod.operand_shapes(ins)]
            key = f"{ops[0]} x {ops[1]} -> {hlo.shapes(ins.type_str)[0][0]}"
            out[key] = out.get(key, 0) + int(mod.runs.get(ins.computation, 0))
    return out


def qat_training(cfg, train, held, teacher, fp32_held, claims, t0):
    """Section 4: the teacher's run with plan.qat=int8 and plan.qat=fp8 (see the docstring)."""
    from jaxscale.plan import Spec
    from jaxscale.strategies import qat
    runs = {"fp32": {"curve": teacher["curve"][:QAT_STEPS], "held": fp32_held,
                     "memory": teacher["step"].memory_analysis()}}
    L = cfg.model.n_layers
    for method in ("int8", "fp8"):
        qcfg = C.apply_overrides(cfg, [f"plan.qat={method}", "plan.fp8_amax_history=16"])
        r = train_run(qcfg, train, QAT_STEPS, initial=teacher["initial"])
        s, step = r["setup"], r["step"]
        total, n = s.eval_step(jax.device_put(r["params"], s.state_shardings.params), held)
        compiled_dots = dot_dtypes(step.as_text())
        program_dots = dot_dtypes(C.with_trip_counts(r["lowered"].as_text(dialect="hlo")))
        runs[method] = {"curve": r["curve"], "held": float(total / n),
                        "memory": step.memory_analysis(),
                        "dots": compiled_dots, "program_dots": program_dots,
                        "terms": {t.what: t.bytes for t in qat.memory(Spec.from_config(qcfg, 8))}}
    tail = {k: sum(r["curve"][-10:]) / 10 for k, r in runs.items()}
    print(f"\n[{time.time() - t0:.0f} s]")
    print(C.table(["plan", "loss step 1", f"step {QAT_STEPS // 2}", "mean of last 10",
                   "vs fp32", "held-out (own forward)"],
                  [[k, f"{r['curve'][0]:.4f}", f"{r['curve'][QAT_STEPS // 2 - 1]:.4f}",
                    f"{tail[k]:.4f}", f"{tail[k] / tail['fp32'] - 1:+.2%}", f"{r['held']:.4f}"]
                   for k, r in runs.items()],
                  title=f"quantisation-aware training, {QAT_STEPS} steps from the same init "
                        f"(dp=8, batch {BATCH} x {SEQ}): plan.qat=none | int8 | fp8"))
    rows = [[m, where, k, v] for m in ("int8", "fp8") for where, key in
            (("compiled", "dots"), ("program", "program_dots")) for k, v in runs[m][key].items()]
    print(C.table(["plan", "HLO", "dot operands -> result", "dots per step"], rows,
                  title="dots of the train step by dtype (loop trip counts included; 'program' "
                        "is the HLO before XLA's passes)"))
    mem = {k: {f: getattr(r["memory"], f"{f}_size_in_bytes") for f in ("argument", "temp")}
           for k, r in runs.items()}
    saved = -runs["fp8"]["terms"]["matmul inputs saved in e4m3 instead of the compute dtype"]
    hist = runs["fp8"]["terms"]["fp8 amax histories"]
    print(C.table(["plan", "argument MiB", "temp MiB", "temp - fp32 (bytes)", "planner"],
                  [[k, f"{m['argument'] / C.MiB:.3f}", f"{m['temp'] / C.MiB:.3f}",
                    f"{m['temp'] - mem['fp32']['temp']:+,}",
                    {"fp32": "", "int8": "no term (STE keeps x, w)",
                     "fp8": f"-{saved:,.0f} saved inputs, +{hist:,.0f} histories"}[k]]
                   for k, m in mem.items()],
                  title="compiled memory per device (memory_analysis)"))
    for k in ("int8", "fp8"):
        claims.check(f"{k} QAT model, own quantised forward: held-out loss within 2% of fp32's",
                     runs[k]["held"] / fp32_held - 1, "|x| < 0.02",
                     abs(runs[k]["held"] / fp32_held - 1) < .02)
    claims.check(f"int8 QAT step: {7 * L} s8 x s8 -> s32 dots (7 block matmuls x {L} layers)",
                 runs["int8"]["dots"].get("s8 x s8 -> s32", 0), 7 * L,
                 runs["int8"]["dots"].get("s8 x s8 -> s32", 0) == 7 * L)
    e4, e5 = "f8e4m3fn", "f8e5m2"
    fp8d = runs["fp8"]["program_dots"]
    claims.check(f"fp8 QAT program: {7 * L} e4m3 x e4m3 forward, {14 * L} e5m2 backward dots",
                 f"{fp8d.get(f'{e4} x {e4} -> f32', 0)}, "
                 f"{fp8d.get(f'{e5} x {e4} -> f32', 0) + fp8d.get(f'{e4} x {e5} -> f32', 0)}",
                 f"{7 * L}, {14 * L}", fp8d.get(f"{e4} x {e4} -> f32", 0) == 7 * L and
                 fp8d.get(f"{e5} x {e4} -> f32", 0) + fp8d.get(f"{e4} x {e5} -> f32", 0) == 14 * L)
    for k in ("int8", "fp8"):
        claims.check(f"{k} QAT tracks fp32: mean loss of the last 10 steps within 2%",
                     tail[k] / tail["fp32"] - 1, "|x| < 0.02",
                     abs(tail[k] / tail["fp32"] - 1) < .02)
    claims.check("int8 QAT needs no more memory than fp32 (temp within 0.1%)",
                 mem["int8"]["temp"] / mem["fp32"]["temp"] - 1, "|x| < 0.001",
                 abs(mem["int8"]["temp"] / mem["fp32"]["temp"] - 1) < 1e-3)
    claims.check("fp8 QAT temp saving vs the planner's saved-input term (within 25%)",
                 mem["fp32"]["temp"] - mem["fp8"]["temp"], f"{saved:,.0f}",
                 abs(mem["fp32"]["temp"] - mem["fp8"]["temp"] - saved) < 0.25 * saved)
    claims.check("fp8 QAT state = the amax histories (argument bytes, exact)",
                 mem["fp8"]["argument"] - mem["fp32"]["argument"], hist,
                 mem["fp8"]["argument"] - mem["fp32"]["argument"] == hist)
    return {k: {"curve": r["curve"], "held": r["held"], "memory": mem[k],
                **({"dots": r["dots"], "program_dots": r["program_dots"], "terms": r["terms"]}
                   if k != "fp32" else {})} for k, r in runs.items()}


def main():
    args = C.parse_args(__doc__, "runs/exp23", lambda ap: ap.add_argument(
        "--figure", default=None, help="also copy the figure here (docs/img/exp23_*.png)"))
    t0 = time.time()
    claims = C.Claims()
    cfg = C.config(*C.DP8, n_layers=4, seq=SEQ, batch=BATCH, steps=TEACHER_STEPS, lr=3e-3)
    corpus = load_corpus(cfg.data)
    train = Batches(corpus.train, BATCH, SEQ, seed=0, pad_id=corpus.pad_id)
    held = Batches(corpus.heldout, EVAL_ROWS, SEQ, seed=1, pad_id=corpus.pad_id).global_rows(0)
    teacher = train_run(cfg, train, TEACHER_STEPS, keep=QAT_STEPS)
    params, curve = teacher["params"], teacher["curve"]
    model = FunctionalModel(dataclasses.replace(cfg.model, dtype="float32"))
    ev = jax.jit(lambda p: mean_loss(model, p, held))
    logits = jax.jit(lambda p: model.apply(p, held["inputs"][:16]))
    ref_logits = logits(params)
    loss_fp32 = float(ev(params))
    print(f"teacher: {TEACHER_STEPS} steps, train loss {curve[0]:.3f} -> {curve[-1]:.3f}, "
          f"held-out {loss_fp32:.4f} ({time.time() - t0:.0f} s)\n")

    # ---- 1. post-training quantisation
    specs = model.logical
    is_w = lambda names: contracted_axes(tuple(names)) is not None
    sizes = [w.size for w, s in zip(jax.tree.leaves(params), jax.tree.leaves(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))) if is_w(s)]
    w_elems = sum(sizes)
    fp32_w = 4 * w_elems
    ptq = {"fp32": {"bytes": fp32_w, "ideal": fp32_w, "loss": loss_fp32, "logit_err": 0.0}}
    for bits in (8, 6, 4):
        q = Q.quantize(params, specs, bits)
        scales = sum(t.scale.size for t in jax.tree.leaves(
            q, is_leaf=lambda x: isinstance(x, Q.QTensor)) if isinstance(t, Q.QTensor))
        stored = Q.nbytes(q) - (Q.nbytes(params) - fp32_w)            # weights + scales
        dq = Q.dequantize(q)
        ptq[f"int{bits}"] = {"bytes": stored, "ideal": w_elems * bits // 8 + 4 * scales,
                             "scales": 4 * scales, "loss": float(ev(dq)),
                             "logit_err": float(jnp.max(jnp.abs(logits(dq) - ref_logits)) /
                                                jnp.max(jnp.abs(ref_logits)))}
    rows = [[k, f"{r['bytes'] / C.MiB:.3f}", f"{r['bytes'] / fp32_w:.4f}",
             f"{r['ideal'] / C.MiB:.3f}", f"{r['loss']:.4f}", f"{r['loss'] - loss_fp32:+.4f}",
             f"{r['logit_err']:.4f}"] for k, r in ptq.items()]
    print(C.table(["weights", "stored MiB", "stored / fp32", "packed MiB", "held-out loss",
                   "delta", "max|dlogit| / max|logit|"], rows,
                  title=f"post-training quantisation, per-channel symmetric ({w_elems:,} weights;"
                        f" norm scales stay fp32)"))
    i8 = ptq["int8"]
    claims.check("int8 stored bytes = fp32 weight bytes / 4 + fp32 scales (exact)", i8["bytes"],
                 fp32_w // 4 + i8["scales"], i8["bytes"] == fp32_w // 4 + i8["scales"])
    i4 = ptq["int4"]
    packed = sum((n + 1) // 2 for n in sizes) + i4["scales"]       # two per byte, per tensor
    claims.check("int4 stored bytes = fp32 weight bytes / 8 (packed) + fp32 scales (exact)",
                 i4["bytes"], packed, i4["bytes"] == packed)
    claims.check("int8 PTQ held-out loss within 0.5% of fp32", i8["loss"] / loss_fp32 - 1,
                 "< 0.005", abs(i8["loss"] / loss_fp32 - 1) < 0.005)
    claims.check("logit error grows as bits fall (int8 < int6 < int4)",
                 " < ".join(f"{ptq[k]['logit_err']:.3g}" for k in ("int8", "int6", "int4")),
                 "increasing", ptq["int8"]["logit_err"] < ptq["int6"]["logit_err"]
                 < ptq["int4"]["logit_err"])

    ft = finetune_step(model, FT_LR)
    ft_dense = finetune(ft, params, train)
    qat = finetune(finetune_step(model, FT_LR, qat_bits=4), params, train)
    q4 = lambda p: float(ev(Q.dequantize(Q.quantize(p, specs, 4))))
    qat_rows = {"int4 PTQ of the teacher": q4(params),
                f"fp32 fine-tune {FT_STEPS} steps, then int4 PTQ": q4(ft_dense),
                f"QAT int4 {FT_STEPS} steps (STE), then int4 PTQ": q4(qat),
                f"fp32 fine-tune {FT_STEPS} steps (fp32 reference)": float(ev(ft_dense))}
    print(f"\n[{time.time() - t0:.0f} s]")
    print(C.table(["model", "held-out loss"], [[k, f"{v:.4f}"] for k, v in qat_rows.items()],
                  title="quantisation-aware fine-tuning at int4 (equal steps, equal batches)"))
    v = list(qat_rows.values())
    claims.check("QAT int4 beats fine-tune + int4 PTQ (loss)", f"{v[2]:.4f}", f"< {v[1]:.4f}",
                 v[2] < v[1])
    claims.check("QAT closes part of the int4 gap ((PTQ - QAT) / (PTQ - fp32))",
                 (v[1] - v[2]) / (v[1] - v[3]), "> 0.25", (v[1] - v[2]) > 0.25 * (v[1] - v[3]))

    # ---- 2. pruning
    base_ft = float(ev(ft_dense))
    prune = {}
    cases = [(f"magnitude {int(s * 100)}%", lambda s=s: M.magnitude_masks(params, specs, s), s)
             for s in SPARSITIES] + [("2:4", lambda: M.nm_masks(params, specs), 0.5)]
    for name, make, target in cases:
        masks = make()
        pruned = M.apply(params, masks)
        tuned = ft_dense if target == 0 else finetune(ft, params, train, masks)
        prune[name] = {"target": target, "sparsity": M.sparsity(pruned, masks),
                       "sparsity_after_ft": M.sparsity(tuned, masks),
                       "loss": float(ev(pruned)), "loss_ft": float(ev(tuned))}
    print(f"\n[{time.time() - t0:.0f} s]")
    print(C.table(["mask", "target", "measured zeros", "loss pruned", "delta",
                   f"loss +{FT_STEPS} FT steps", "delta vs dense FT"],
                  [[k, f"{r['target']:.2f}", f"{r['sparsity']:.4f}", f"{r['loss']:.4f}",
                    f"{r['loss'] - loss_fp32:+.4f}", f"{r['loss_ft']:.4f}",
                    f"{r['loss_ft'] - base_ft:+.4f}"] for k, r in prune.items()],
                  title="pruning (matmul weights; per-matrix magnitude or 2:4 along the input "
                        "axis)"))
    for k, r in prune.items():
        claims.check(f"{k}: sparsity as set, also after fine-tuning", r["sparsity_after_ft"],
                     r["target"], abs(r["sparsity"] - r["target"]) < 1e-4
                     and abs(r["sparsity_after_ft"] - r["target"]) < 1e-4)
    mag = [prune[f"magnitude {int(s * 100)}%"]["loss"] for s in SPARSITIES]
    claims.check("loss grows with magnitude sparsity (no fine-tuning)",
                 " < ".join(f"{x:.3f}" for x in mag), "increasing",
                 all(a < b for a, b in zip(mag, mag[1:])))
    rec = [k for k, r in prune.items() if r["target"] > 0 and not r["loss_ft"] < r["loss"]]
    claims.check("fine-tuning with the mask kept lowers every pruned model's loss",
                 ", ".join(rec) or "all lower", "all lower", not rec)
    claims.check("2:4 (50%, structured) loses more than magnitude 50% (unstructured)",
                 f"{prune['2:4']['loss']:.4f}", f">= {prune['magnitude 50%']['loss']:.4f}",
                 prune["2:4"]["loss"] >= prune["magnitude 50%"]["loss"])

    # ---- 3. distillation
    s_model = FunctionalModel(dataclasses.replace(model.cfg, n_layers=2))
    s_init = jax.jit(s_model.init)(jax.random.key(7))
    kl_fn = jax.jit(lambda sp: distill_lib.distillation_loss(s_model.apply(sp, held["inputs"]),
                                                   model.apply(params, held["inputs"]), 1.0,
                                                   held["mask"]))
    s_ev = jax.jit(lambda p: mean_loss(s_model, p, held))
    kd = {}
    steps = {use: distill_step(s_model, model, params, use) for use in (False, True)}
    for name, how in KD.items():
        p = distill(steps[how is not None], s_init, train, *(how or ()))
        kd[name] = {"loss": float(s_ev(p)), "kl": float(kl_fn(p))}
    n_t, n_s = (sum(x.size for x in jax.tree.leaves(t)) for t in (params, s_init))
    print(f"\n[{time.time() - t0:.0f} s]")
    print(C.table(["student (2 layers)", "params", "held-out CE", "KL(teacher || student), T=1"],
                  [["teacher (4 layers)", f"{n_t:,}", f"{loss_fp32:.4f}", "0"]] +
                  [[k, f"{n_s:,}", f"{r['loss']:.4f}", f"{r['kl']:.4f}"] for k, r in kd.items()],
                  title=f"distillation, {KD_STEPS} student steps each (same init, batches, lr)"))
    ce, kdr = kd["CE only"], kd["KD alpha=0.5 T=1"]
    claims.check("KD (T=1) student is closer to the teacher (KL) than the CE student", kdr["kl"],
                 f"< {ce['kl']:.4f}", kdr["kl"] < ce["kl"])
    claims.check("KD (T=1) student's held-out CE no worse than CE-only's", kdr["loss"],
                 f"<= {ce['loss']:.4f}", kdr["loss"] <= ce["loss"])

    qat_runs = qat_training(cfg, train, held, teacher, float(ev(teacher["kept"])), claims, t0)

    plt = C.pyplot()
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    ax = ax.ravel()
    names = list(ptq)
    ax[0].bar(names, [ptq[k]["loss"] - loss_fp32 for k in names], color="C0")
    for i, k in enumerate(names):
        ax[0].annotate(f"{ptq[k]['bytes'] / C.MiB:.2f} MiB", (i, ptq[k]["loss"] - loss_fp32),
                       ha="center", va="bottom", fontsize=8)
    ax[0].set_ylabel("held-out loss - fp32")
    ax[0].set_title("PTQ: loss increase (weight bytes on top)")
    ax[1].plot([100 * s for s in SPARSITIES], mag, "o-", label="magnitude, pruned")
    ax[1].plot([100 * s for s in SPARSITIES],
               [prune[f"magnitude {int(s * 100)}%"]["loss_ft"] for s in SPARSITIES], "o--",
               label=f"magnitude, +{FT_STEPS} FT steps")
    ax[1].plot([50], [prune["2:4"]["loss"]], "s", color="C3", label="2:4, pruned")
    ax[1].plot([50], [prune["2:4"]["loss_ft"]], "D", color="C3", mfc="none",
               label=f"2:4, +{FT_STEPS} FT steps")
    ax[1].set_xlabel("sparsity of matmul weights (%)")
    ax[1].set_ylabel("held-out loss")
    ax[1].set_title("pruning")
    ax[1].legend(fontsize=8)
    labels = [k.replace(" alpha=", "\nalpha=").replace(" T", "\nT") for k in kd]
    ax[2].bar(["teacher\n4 layers"] + labels,
              [loss_fp32] + [r["loss"] for r in kd.values()], color=["C7", "C0", "C2", "C1"])
    ax[2].set_ylim(min(loss_fp32, *(r["loss"] for r in kd.values())) * 0.95, None)
    ax[2].set_ylabel("held-out loss")
    ax[2].set_title(f"2-layer student, {KD_STEPS} steps")
    base = qat_runs["fp32"]["curve"]
    for k, style in (("int8", "C1"), ("fp8", "C2")):
        ax[3].plot(range(1, QAT_STEPS + 1), [a - b for a, b in zip(qat_runs[k]["curve"], base)],
                   color=style, label=f"plan.qat={k}: held-out {qat_runs[k]['held']:.4f} "
                                      f"(fp32 {qat_runs['fp32']['held']:.4f})")
    ax[3].axhline(0, color="C0", lw=0.8)
    ax[3].set_xlabel("step")
    ax[3].set_ylabel("train loss - fp32 train loss (same step)")
    ax[3].set_title(f"QAT vs fp32: same init, batches, schedule; dp=8 "
                    f"(fp32 loss {base[0]:.2f} -> {base[-1]:.2f})", fontsize=10)
    ax[3].legend(fontsize=8)
    fig.tight_layout()
    path = C.save(fig, args.out, "compression.png")
    if args.figure:
        shutil.copyfile(path, args.figure)
        print(f"wrote {args.figure}")
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {"teacher_curve": curve, "ptq": ptq, "qat": qat_rows,
                             "pruning": prune, "distillation": kd, "qat_training": qat_runs})


if __name__ == "__main__":
    main()
