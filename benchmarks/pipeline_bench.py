"""The pipeline schedules in wall time on the machine at hand (a stage of `benchmarks.gpu_check`).

    python -m benchmarks.pipeline_bench --out runs/pipeline_bench          # a GPU machine
    python -m benchmarks.pipeline_bench --allow-cpu --tiny                 # CPU smoke test

One device: a stage's op costs measured on it, at the shape a p-stage pipeline gives each stage
(L / p layers, one micro-batch): T_F the forward; T_B the input-gradient backward (the weights
constants, as a zero-bubble B runs it); T_W what the whole backward adds to it (the weight
gradients). Each schedule is then run by the simulator (`strategies.pp.simulator`) with those
costs: makespan and bubble in wall time, beside the ideal m (T_F + T_B + T_W) of a stage
without a bubble. With several devices, also the engine itself timed over pp = devices for every
schedule, beside the unpipelined step over dp = devices. Writes `pipeline.json` and prints a table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


def op_costs(cfg, p: int) -> dict:
    """T_F, T_B (input gradient only), T_W (the rest of the backward) of one stage of L / p layers
    and one micro-batch, on one device, in seconds."""
    import jax
    import jax.numpy as jnp

    from jaxscale.analysis.profiling import median_seconds
    from jaxscale.train.state import FunctionalModel
    model = FunctionalModel(cfg.model)
    params = jax.jit(model.init)(jax.random.key(0))
    n = max(1, cfg.model.n_layers // p)
    lay = jax.tree.map(lambda a: a[:n], params["layers"])
    B, T = cfg.data.batch_size // max(1, cfg.plan.accumulate), cfg.data.seq_len
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.model.dim), jnp.dtype(cfg.model.dtype))

    def stage(lay, x):
        m = model.module({**params, "layers": lay})
        return jnp.sum(m.blocks(x)[0].astype(jnp.float32))
    fwd = jax.jit(stage)
    both = jax.jit(jax.grad(stage, argnums=(0, 1)))
    inp = jax.jit(jax.grad(stage, argnums=1))
    t_f, t_all, t_in = (median_seconds(f, lay, x) for f in (fwd, both, inp))
    return {"layers": n, "t_f": t_f, "t_b": max(t_in - t_f, 1e-9),
            "t_w": max(t_all - t_in, 1e-9)}


def simulated(costs: dict, p: int, m: int) -> list[dict]:
    from jaxscale.strategies.pp import schedules as ps
    from jaxscale.strategies.pp.simulator import simulate
    t_f, t_b, t_w = costs["t_f"], costs["t_b"], costs["t_w"]
    rows = []
    for name in SCHEDULES:
        try:
            sc = ps.make(name, p, m, 2 if name == "interleaved" else 1)
        except ValueError as e:
            rows.append({"schedule": name, "skipped": str(e)})
            continue
        r = simulate(sc, t_f, t_b, t_w)
        rows.append({"schedule": name, "makespan_s": r.makespan, "bubble": r.bubble,
                     "ideal_s": m * (t_f + t_b + t_w)})
    return rows


def engine_times(base: list[str], p: int, m: int) -> list[dict]:
    """The train step over pp = p devices per schedule, and over dp = p unpipelined."""
    from jaxscale.analysis.profiling import median_seconds
    from jaxscale.analysis.validation import tiny_config
    from jaxscale.data import Batches, load_corpus
    from jaxscale.train.setup import build

    def step_time(overrides):
        s = build(tiny_config(*base, *overrides))
        b = Batches(load_corpus(s.cfg.data).train, s.cfg.data.batch_size, s.cfg.data.seq_len)
        state, batch = s.init_state(), b.device_batch(0, s.batch_shardings())
        box = {"state": state}

        def one():
            box["state"], m_ = s.train_step(box["state"], batch)
            return m_["loss"]
        return median_seconds(one)
    rows = [{"schedule": "unpipelined dp", "step_s": step_time(
        (f"mesh.dp={p}", "mesh.pp=1", f"plan.accumulate={m}"))}]
    for name in SCHEDULES:
        extra = ("plan.virtual_stages=2",) if name == "interleaved" else ()
        try:
            t = step_time(("mesh.dp=1", f"mesh.pp={p}", f"plan.schedule={name}",
                           f"plan.accumulate={m}", *extra))
        except ValueError as e:
            rows.append({"schedule": name, "skipped": str(e).splitlines()[-1]})
            continue
        rows.append({"schedule": name, "step_s": t})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/pipeline_bench")
    ap.add_argument("--allow-cpu", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--p", type=int, default=4, help="stages simulated on one device")
    ap.add_argument("--m", type=int, default=8, help="micro-batches")
    ap.add_argument("--devices", type=int, default=0,
                    help="devices to use (default all; 1: the op costs and the simulation only)")
    a = ap.parse_args(argv)
    import jax

    from jaxscale.analysis.validation import tiny_config
    if not a.allow_cpu and jax.default_backend() != "gpu":
        ap.error("no GPU: use --allow-cpu --tiny for a CPU smoke test")
    shape = (["model.n_layers=8", "data.seq_len=64", "model.dim=128"] if a.tiny else
             ["model.dim=2048", "model.n_layers=16", "model.n_heads=16", "model.n_kv_heads=8",
              "model.ffn_dim=5632", "model.max_seq_len=2048", "data.seq_len=2048"])
    base = [*shape, f"data.batch_size={2 * a.m}", "plan.precision=bf16", "mesh.fsdp=1",
            "mesh.tp=1", "plan.check_memory=false"]
    cfg = tiny_config(*base, f"plan.accumulate={a.m}")
    n = a.devices or jax.device_count()
    p = n if n > 1 else a.p
    costs = op_costs(cfg, p)
    out = {"device": str(jax.devices()[0].device_kind), "devices": n, "p": p, "m": a.m,
           "costs": costs, "simulated": simulated(costs, p, a.m),
           "engine": engine_times(base, n, a.m) if n > 1 else []}
    path = Path(a.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "pipeline.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"stage costs ({costs['layers']} layers, one micro-batch): T_F {costs['t_f']*1e3:.2f} ms,"
          f" T_B {costs['t_b']*1e3:.2f} ms, T_W {costs['t_w']*1e3:.2f} ms")
    print(f"{'schedule':12s} {'makespan ms':>12s} {'bubble':>8s}   (p={p}, m={a.m}, simulated)")
    for r in out["simulated"]:
        if "skipped" in r:
            print(f"{r['schedule']:12s} skipped: {r['skipped'][:60]}")
        else:
            print(f"{r['schedule']:12s} {r['makespan_s']*1e3:12.2f} {r['bubble']:8.1%}")
    for r in out["engine"]:
        print(f"engine {r['schedule']:16s} " + (f"{r['step_s']*1e3:.1f} ms" if "step_s" in r
                                                 else f"skipped: {r['skipped'][:60]}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
