"""python experiments/12_gradient_compression.py [--out runs/12_gradient_compression] [--steps 500]

Topic 12: gradient compression on the data axis (8 simulated CPU devices, `dp` = 8). Every method
of `jaxscale.strategies.compression.methods` (fp32 all-reduce, bf16, fp8 and int8 with per-block
scales, 1-bit sign, top-k, threshold, PowerSGD; error feedback where the method has it, top-k also
without) trains
1. a quadratic: min_w mean_d |w - t_d|^2, w [32, 32], each worker its own target t_d (its
   gradients differ from the others'), SGD; the loss is the excess |w - mean_d t_d|^2;
2. a small MLP regression (16 -> 64 -> 8, tanh) on a teacher, each worker its own input
   distribution (shifted mean), SGD on the compressed mean gradient; the loss is the global MSE.
Per method: the per-device wire bytes of one gradient mean read from the compiled program's
census beside `formulas.wire_bytes` (they must be equal), its ratio to the fp32 all-reduce, and
the final losses; plus the formulas for one 4096 x 4096 matrix.
3. HSDP: the tiny LLaMA on dp2 x fsdp2 x tp2 with `plan.compression` = none, bf16, int8,
   PowerSGD: the compressed mean runs over dp alone (the slow cross-node axis), after fsdp's
   reduce-scatter and beside tp, on each device's shard; the bytes over dp from the compiled
   step's census beside inspect's theory, and their ratio to the fp32 reduction.
Writes results.json and compression.png under --out. About a minute on 2 cores.
"""
from __future__ import annotations

import time

import _common as CM  # first: 8 simulated devices before jax is imported

CM.cpu_only()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxscale.analysis import inspect  # noqa: E402
from jaxscale.strategies.compression import formulas as F  # noqa: E402
from jaxscale.strategies.compression import methods as C  # noqa: E402

N = CM.DEVICES
AX = ("dp",)
# (label, method, params, error feedback)
RUNS = [("fp32 all-reduce", "fp32", {}, False),
        ("bf16", "bf16", {}, False),
        ("fp8 e4m3 /128", "fp8", {"block": 128}, False),
        ("int8 /128", "int8", {"block": 128}, False),
        ("1-bit sign /128 + EF", "sign", {"block": 128}, True),
        ("top-k 1/32 + EF", "topk", {"density": 1 / 32}, True),
        ("top-k 1/32, no EF", "topk", {"density": 1 / 32}, False),
        ("threshold (cap 1/16) + EF", "threshold", {"density": 1 / 16, "threshold": 0.02}, True),
        ("PowerSGD r=2 + EF", "powersgd", {"rank": 2}, True)]


def params_for(method, p, size):
    p = dict(p)
    if "density" in p:
        p["k"] = max(1, int(p.pop("density") * size))
    return p


def train(mesh, method, params, ef, grad_fn, loss_fn, init, data, lr, steps):
    """SGD on the compressed mean gradient, all steps in one jit (scan inside shard_map).
    grad_fn(w, local data) -> this worker's gradient; loss_fn(w) -> the global loss, computed on
    every device from replicated constants (no collective: the census holds only the mean's).
    Returns the loss per step and the census wire bytes of the run divided by the steps."""
    st = C.init_state(method, init, N, error_feedback=ef, **params)
    st = None if st is None else C.stack(st, N)
    specs = None if st is None else C.state_specs(st, AX)

    def body(d, s):
        d = jax.tree.map(lambda a: a[0], d)
        s = None if s is None else jax.tree.map(lambda a: a[0], s)

        def step(carry, _):
            w, s = carry
            mean, s = C.compressed_mean(method, grad_fn(w, d), s, AX, **params)
            w = jax.tree.map(lambda a, b: a - lr * b, w, mean)
            return (w, s), loss_fn(w)
        return jax.lax.scan(step, (init, s), None, length=steps)[1]
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX), specs), out_specs=P()))
    comp = fn.lower(data, st).compile()
    losses = np.asarray(comp(data, st))
    census = inspect.census(comp.as_text(), mesh)
    per_step = sum(r["wire_bytes"] for r in census) / steps
    return losses, per_step


def quadratic(seed=0):
    t = jnp.asarray(np.random.default_rng(seed).normal(size=(N, 32, 32)).astype(np.float32))
    tbar = t.mean(0)

    return (lambda w, t_local: 2 * (w - t_local), lambda w: jnp.sum((w - tbar) ** 2),
            jnp.zeros((32, 32)), t)


def mlp(seed=0, per_worker=64):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))
    teacher = {"w1": f(16, 64) / 4, "b1": f(64) / 4, "w2": f(64, 8) / 8, "b2": f(8) / 8}
    shift = f(N, 1, 16)                                   # each worker its own input mean
    x = f(N, per_worker, 16) + shift
    apply = lambda p, x: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    y = jax.vmap(lambda xx: apply(teacher, xx))(x)
    student = {"w1": f(16, 64) / 4, "b1": jnp.zeros(64), "w2": f(64, 8) / 8, "b2": jnp.zeros(8)}

    mse = lambda p, x, y: jnp.mean((apply(p, x) - y) ** 2)
    x_all, y_all = x.reshape(-1, 16), y.reshape(-1, 8)
    # the parameters are replicated (invariant over dp); differentiating them directly would
    # make shard_map insert the exact psum of the gradient (the transpose of the implicit
    # pvary). Cast them to per-device first: the gradient stays local, compression reduces it.
    local_grad = lambda p, d: jax.grad(mse)(jax.lax.pcast(p, AX, to="varying"), d[0], d[1])
    return (local_grad, lambda p: mse(p, x_all, y_all),
            student, (x, y))


def main() -> None:
    args = CM.parse_args(__doc__, "runs/12_gradient_compression",
                         lambda ap: ap.add_argument("--steps", type=int, default=500))
    mesh = jax.make_mesh((N,), AX, axis_types=(AxisType.Auto,))
    problems = {"quadratic": (quadratic(), 0.01), "mlp": (mlp(), 0.2)}
    claims, results, curves = CM.Claims(), {"runs": []}, {}
    t0 = time.time()
    for label, method, p, ef in RUNS:
        row = {"label": label, "method": method}
        for name, ((grad_fn, loss_fn, init, data), lr) in problems.items():
            shapes = [leaf.shape for leaf in jax.tree.leaves(init)]
            size = sum(int(np.prod(s)) for s in shapes)
            params = params_for(method, p, size)
            losses, census_bytes = train(mesh, method, params, ef, grad_fn, loss_fn, init,
                                         data, lr, args.steps)
            formula = F.wire_bytes(method, shapes, N, **params)
            fp32 = F.wire_bytes("fp32", shapes, N)
            curves[(name, label)] = losses
            row[name] = {"final_loss": float(losses[-1]), "first_loss": float(losses[0]),
                         "census_wire_bytes": census_bytes, "formula_wire_bytes": formula,
                         "ratio_to_fp32": formula / fp32, "params": params,
                         "payload_bytes": F.payload_bytes(method, shapes, N, **params)}
            claims.check(f"{name} {label}: census wire bytes/step = wire_bytes()",
                         census_bytes, float(formula), abs(census_bytes - formula) < 0.5)
        results["runs"].append(row)
    elapsed = time.time() - t0
    big = [(4096, 4096)]
    for label, method, p, _ in RUNS:
        params = params_for(method, p, 4096 * 4096)
        r = next(x for x in results["runs"] if x["label"] == label)
        r["matrix_4096"] = {"wire_bytes": F.wire_bytes(method, big, N, **params),
                            "ratio_to_fp32": F.wire_bytes(method, big, N, **params) /
                            F.wire_bytes("fp32", big, N)}

    rows = [[r["label"], int(r["quadratic"]["census_wire_bytes"]),
             f"{r['quadratic']['ratio_to_fp32']:.4f}", f"{r['quadratic']['final_loss']:.3g}",
             int(r["mlp"]["census_wire_bytes"]), f"{r['mlp']['ratio_to_fp32']:.4f}",
             f"{r['mlp']['final_loss']:.3g}", f"{r['matrix_4096']['ratio_to_fp32']:.4f}"]
            for r in results["runs"]]
    print(CM.table(["method", "quad B/step", "quad ratio", "quad loss", "mlp B/step",
                    "mlp ratio", "mlp loss", "4096^2 ratio"], rows,
                   title=f"wire bytes per device per step (census of the compiled run = "
                         f"wire_bytes), ratio to the fp32 all-reduce, final loss after "
                         f"{args.steps} steps, 8 devices"))
    first = {n: results["runs"][0][n]["first_loss"] for n in problems}
    print(f"\nstarting losses: quadratic {first['quadratic']:.3g}, mlp {first['mlp']:.3g}; "
          f"{len(RUNS) * len(problems)} runs in {elapsed:.0f} s")

    by = {r["label"]: r for r in results["runs"]}
    q = lambda label, key="final_loss": by[label]["quadratic"][key]
    claims.close("quadratic int8 /128 wire bytes / fp32 (1/4 + scales)",
                 q("int8 /128", "ratio_to_fp32"), 0.25 * (1 + 4 / 128), 1e-6)
    claims.check("quadratic: top-k + EF ends 10x below top-k without EF",
                 q("top-k 1/32 + EF"), q("top-k 1/32, no EF") / 10,
                 q("top-k 1/32 + EF") < q("top-k 1/32, no EF") / 10)
    claims.check("quadratic: top-k without EF stalls (> 1/2 the start)", q("top-k 1/32, no EF"),
                 first["quadratic"] / 2, q("top-k 1/32, no EF") > first["quadratic"] / 2)
    for label in ("int8 /128", "fp8 e4m3 /128", "bf16", "PowerSGD r=2 + EF"):
        claims.check(f"mlp: {label} within 2x of fp32's final loss (+1e-4)",
                     by[label]["mlp"]["final_loss"], by["fp32 all-reduce"]["mlp"]["final_loss"],
                     by[label]["mlp"]["final_loss"] <
                     2 * by["fp32 all-reduce"]["mlp"]["final_loss"] + 1e-4)

    results["hsdp"] = hsdp(claims)

    plt = CM.pyplot()
    fig, axs = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, name, ylabel in ((axs[0], "quadratic", "excess loss |w - mean t|^2"),
                             (axs[1], "mlp", "global MSE")):
        for i, (label, *_rest) in enumerate(RUNS):
            ax.plot(curves[(name, label)], label=label, color=f"C{i}",
                    ls="--" if "no EF" in label else "-", lw=1.2)
        ax.set(yscale="log", xlabel="step", ylabel=ylabel,
               title=f"{name}: SGD on the compressed mean of 8 workers' gradients")
        ax.legend(fontsize=7)
    CM.save(fig, args.out, "compression.png")
    claims.finish(args.out, results)


HSDP = ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2")


def hsdp(claims) -> list[dict]:
    """Compressed cross-node (dp) bytes on dp2 x fsdp2 x tp2, census beside theory."""
    rows = []
    for method in ("none", "bf16", "int8", "powersgd"):
        rep = inspect.report(CM.config(*HSDP, f"plan.compression={method}",
                                       "plan.compression_rank=2"))
        over = [r for r in rep["theory"] if "dp" in r["axes"]]
        rows.append({"method": method, "census": sum(r["census_bytes"] for r in over),
                     "theory": sum(r["theory_bytes"] for r in over),
                     "kinds": sorted({r["kind"] for r in over if r["census_bytes"]})})
    fp32 = rows[0]["census"]
    print()
    print(CM.table(["plan.compression", "census B over dp", "theory B", "ratio to fp32",
                    "collectives over dp"],
                   [[r["method"], r["census"], int(r["theory"]), f"{r['census'] / fp32:.3f}",
                     ", ".join(r["kinds"])] for r in rows],
                   title="HSDP (dp2 x fsdp2 x tp2, tiny LLaMA): gradient bytes per step over dp"))
    for r in rows:
        r["ratio_to_fp32"] = r["census"] / fp32
        claims.close(f"HSDP {r['method']}: census bytes over dp = inspect's theory",
                     r["census"], r["theory"], 1e-3)
        if r["method"] != "none":
            claims.check(f"HSDP {r['method']}: fewer bytes over dp than fp32", r["ratio_to_fp32"],
                         "< 1", r["ratio_to_fp32"] < 1)
    return rows


if __name__ == "__main__":
    main()
