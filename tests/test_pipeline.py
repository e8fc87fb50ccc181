"""The pipeline engine over pp (`jaxscale.strategies.pp.engine`): every schedule's loss and
gradients equal the unpipelined model's with fsdp and tp on the same mesh; the compiled
collective-permutes and memory against the planner (GPipe growing with m, 1F1B flat); a checkpoint
written under an interleaved pp=2 plan restored at pp=1; a composed plan (dp, tp, ZeRO-1, bf16,
remat) training as the same plan without pp does; clear errors for plans the engine cannot run."""
import jax
import numpy as np
import pytest

from jaxscale import plan, planner
from jaxscale.analysis import inspect
from jaxscale.strategies.pp import program, stages
from jaxscale.train.setup import build
from tests import numerics
from tests.helpers import tiny_config

L = 8                                  # layers: divisible by every p x v below
BASE = (f"model.n_layers={L}", "data.batch_size=16", "mesh.dp=1")


def _batch(B=16, T=32, seed=0):
    rng = np.random.default_rng(seed)
    b = {"inputs": rng.integers(0, 300, (B, T)), "targets": rng.integers(0, 300, (B, T))}
    b = {k: v.astype(np.int32) for k, v in b.items()}
    mask = np.ones((B, T), np.float32)
    mask[3, 5:] = 0                    # padding: the token mean must not count it
    return {**b, "mask": mask}


@pytest.fixture(scope="module")
def reference():
    """Parameters (model order, on the host), and their unpipelined gradients and loss."""
    s = build(tiny_config(*BASE, "mesh.fsdp=8", "mesh.tp=1"))
    params = s.init_state().params
    grads, loss, ntok = s.jit_grads()(params, _batch())
    return jax.device_get(params), jax.device_get(grads), float(loss), float(ntok)


def _pipelined_grads(overrides, params):
    s = build(tiny_config(*BASE, *overrides))
    order = stages.layer_order(s.placement.spec)
    local = jax.device_put(stages.reorder(params, None, order), s.device_shardings.params)
    grads, loss, ntok = s.jit_grads()(local, _batch())
    return jax.device_get(stages.reorder(grads, order, None)), float(loss), float(ntok), s


SCHEDULES = {   # p, m, v over the same 8 devices as fsdp x tp
    "naive p4 tp2": ("mesh.pp=4", "mesh.fsdp=1", "mesh.tp=2", "plan.schedule=naive"),
    "gpipe p2 m4 fsdp4": ("mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1", "plan.schedule=gpipe",
                          "plan.accumulate=4"),
    "1f1b p2 m8 fsdp2 tp2": ("mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2", "plan.schedule=1f1b",
                             "plan.accumulate=8"),
    "interleaved p2 m4 v2 fsdp2 tp2": ("mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2",
                                       "plan.schedule=interleaved", "plan.virtual_stages=2",
                                       "plan.accumulate=4"),
    "zb-h1 p4 m4 fsdp2": ("mesh.pp=4", "mesh.fsdp=2", "mesh.tp=1", "plan.schedule=zb-h1",
                          "plan.accumulate=4"),
}


@pytest.mark.parametrize("case", SCHEDULES)
def test_schedule_matches_the_unpipelined_model(case, reference):
    params, want, loss_ref, ntok_ref = reference
    got, loss, ntok, _ = _pipelined_grads(SCHEDULES[case], params)
    assert ntok == ntok_ref == 16 * 32 - 27
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = _leaf(want, path)
        scale = float(np.max(np.abs(w)))
        assert scale > 0, jax.tree_util.keystr(path)           # every gradient is non-trivial
        np.testing.assert_allclose(g, w, atol=1e-5 * scale, rtol=0,
                                   err_msg=jax.tree_util.keystr(path))


def _leaf(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_interleaved_layer_order_round_trips():
    spec = plan.Spec.from_config(tiny_config(*BASE, "mesh.pp=2", "mesh.fsdp=4",
                                             "plan.schedule=interleaved", "plan.virtual_stages=2",
                                             "plan.accumulate=4"))
    # device 0 holds stages 0 and 2 (layers 0-1, 4-5), device 1 stages 1 and 3
    assert stages.layer_order(spec) == [0, 1, 4, 5, 2, 3, 6, 7]
    tree = {"layers": {"w": np.arange(L)}, "embed": np.arange(3)}
    moved = stages.reorder(tree, None, stages.layer_order(spec))
    assert list(moved["layers"]["w"]) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert list(stages.reorder(moved, stages.layer_order(spec), None)["layers"]["w"]) == list(
        range(L))
    assert stages.layer_order(spec.with_(schedule="1f1b", virtual_stages=1)) is None


# ----------------------------------------------------------------------------- census, memory
@pytest.fixture(scope="module")
def reports():
    """Compiled train steps of GPipe and 1F1B, pp=2 x fsdp=4, m = 2 and 4 (seq 64)."""
    out = {}
    for name in ("gpipe", "1f1b"):
        for m in (2, 4):
            cfg = tiny_config("model.n_layers=4", "mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4",
                              "mesh.tp=1", f"plan.schedule={name}", f"plan.accumulate={m}",
                              f"data.batch_size={4 * m}", "data.seq_len=64")
            out[name, m] = cfg, inspect.report(cfg)
    return out


def test_permutes_and_pipeline_all_reduce_match_the_formula(reports):
    for (name, m), (cfg, rep) in reports.items():
        spec = plan.Spec.from_config(cfg)
        prog = program.program_for(spec)
        row = next(r for r in rep["collectives"]
                   if r["kind"] == "collective-permute" and r["axes"] == ["pp"])
        act = 1 * 64 * 128 * 4                       # a micro-batch's row per device, [1, T, D]
        # p = 2: one ring (0 <-> 1) carries the activations up and the gradients down at once
        assert prog.rings == {"up": ((0, 1), (1, 0)), "down": ()}
        assert row["count"] == prog.permutes == prog.ticks
        assert row["bytes"] == prog.permutes * act
        assert prog.ticks == 2 * (m + 2 - 1)           # GPipe and 1F1B: 2 (m + p - 1) ticks
        assert prog.useful_sends < prog.permutes       # the loop also sends in idle ticks
        for r in rep["theory"]:                        # every row, the census's own comparison
            assert r["theory_bytes"] == pytest.approx(r["census_bytes"], rel=0.02), (name, m, r)


def test_gpipe_memory_grows_with_m_and_1f1b_stays_flat(reports):
    temp = {k: rep["memory"]["temp"] for k, (_, rep) in reports.items()}
    one_res = temp["gpipe", 4] - temp["gpipe", 2]      # two more micro-batches' residuals
    assert one_res > 0.25 * temp["gpipe", 2]
    assert abs(temp["1f1b", 4] - temp["1f1b", 2]) < 0.01 * temp["1f1b", 2]
    assert temp["gpipe", 4] > 1.3 * temp["1f1b", 4]
    for (name, m), (cfg, rep) in reports.items():
        pred = planner.predict(cfg).memory.xla["temp"]
        assert pred == pytest.approx(rep["memory"]["temp"], rel=0.10), (name, m)


def test_flops_are_the_model_flops(reports):
    """A device runs one op per tick: the census weighs the switch's branches by the schedule."""
    for (name, m), (cfg, rep) in reports.items():
        assert planner.predict(cfg).flops.per_device == pytest.approx(
            rep["flops"]["dot_flops"], rel=0.01)


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_zero_bubble_costs_the_flops_of_1f1b(name, reports):
    """The zero-bubble W computes only the weight gradients, from the matmul inputs and output
    gradients B kept on its tape: the compiled matmul FLOPs within 2% of 1F1B's (same plan,
    m = 4), the planner's temporaries (the tape slots) within 10%, every census row its formula."""
    cfg_1f1b, one = reports["1f1b", 4]
    cfg = tiny_config("model.n_layers=4", "mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1",
                      f"plan.schedule={name}", "plan.accumulate=4", "data.batch_size=16",
                      "data.seq_len=64")
    rep = inspect.report(cfg)
    assert rep["flops"]["dot_flops"] == pytest.approx(one["flops"]["dot_flops"], rel=0.02)
    assert planner.predict(cfg).memory.xla["temp"] == pytest.approx(rep["memory"]["temp"],
                                                                    rel=0.10)
    for r in rep["theory"]:
        assert r["theory_bytes"] == pytest.approx(r["census_bytes"], rel=0.02), (name, r)


# ----------------------------------------------------------------------------- composition
def test_checkpoint_from_interleaved_pp2_restores_at_pp1(tmp_path):
    """One real AdamW update (warm-up 0) under interleaved pp2 (bf16, an fp32 master), saved in
    the model's layer order, restored at pp1: the restored state is the trained one bit for bit,
    as far from pp1's own initial weights as the update moved them (`numerics.MOVED["adamw"]`
    learning rates on average at least: a restore that loaded nothing fails), and its forward
    gives the pipeline's loss."""
    from jaxscale.data import Batches, load_corpus
    from jaxscale.train import checkpoint as ckpt_lib
    from jaxscale.train import checkpoint_meta as ckpt_meta
    from jaxscale.train import disk
    pp_cfg = tiny_config(*BASE, "mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2", "plan.precision=bf16",
                         "plan.schedule=interleaved", "plan.virtual_stages=2", "plan.accumulate=4")
    s = build(pp_cfg)
    order = stages.layer_order(s.placement.spec)
    vocab, lr = pp_cfg.model.vocab_size, pp_cfg.optim.lr

    def host(state, layer_order):        # the fp32 master, the bf16 weights: the model's order
        kept = disk.to_disk(state, vocab, layer_order)
        return [np.asarray(a, np.float32) for a in jax.tree.leaves(jax.device_get(
            (kept.master, kept.params)))]

    def moved(a, b):                     # the master's mean |a - b|, in learning rates
        n = len(a) // 2
        return np.concatenate([np.abs(x - y).ravel() for x, y in zip(a[:n], b[:n])]).mean() / lr
    state = s.init_state()
    initial = host(state, order)
    data = Batches(load_corpus(pp_cfg.data).train, pp_cfg.data.batch_size, pp_cfg.data.seq_len,
                   seed=0)
    state, _ = s.train_step(state, data.device_batch(0, s.batch_shardings()))
    trained = host(state, order)
    assert moved(trained, initial) >= numerics.MOVED["adamw"]
    ck = ckpt_lib.Checkpointer(tmp_path, pp_cfg.ckpt)
    kept = disk.to_disk(state, vocab, order)                        # the model's layer order
    ck.save(1, kept, ckpt_meta.make_meta(pp_cfg, kept, 1))
    ck.wait()
    ck.close()
    one_cfg = tiny_config(*BASE, "mesh.fsdp=8", "mesh.tp=1", "plan.precision=bf16")
    one = build(one_cfg)
    _, restored, meta, _ = ckpt_lib.restore_latest(tmp_path, one_cfg.ckpt, one_cfg,
                                                   one.abstract_state(), None)
    assert "layer_order" not in meta and order is not None
    back = host(restored, None)
    assert all(np.array_equal(a, b) for a, b in zip(back, trained))
    assert moved(back, host(one.init_state(), None)) >= numerics.MOVED["adamw"]
    batch = _batch(8)
    with jax.set_mesh(one.placement.mesh):
        want = one.eval_step(restored.params, batch)
    with jax.set_mesh(s.placement.mesh):
        got = s.eval_step(state.params, batch)          # the forward-only pipeline program
    assert float(got[0]) == pytest.approx(float(want[0]), rel=2e-3)
    assert float(got[1]) == float(want[1])


def test_composed_plan_trains_like_the_same_plan_without_pp():
    """dp2 x pp2 x tp2 1F1B with ZeRO-1, bf16, full remat and 2 micro-batches against the same
    plan with the pipeline's devices given to dp: 3 updates from the same initial weights (one
    seed, the model's layer order), within bf16's tolerance (`tests/numerics.py`)."""
    common = ("mesh.fsdp=1", "mesh.tp=2", "plan.precision=bf16", "plan.zero=1",
              "plan.remat=full", "plan.accumulate=2", "model.n_layers=4")
    pp = numerics.run((*common, "mesh.dp=2", "mesh.pp=2", "plan.schedule=1f1b"))
    flat = numerics.run((*common, "mesh.dp=4"))
    numerics.assert_matches(pp, flat, numerics.BF16)


@pytest.mark.parametrize("overrides,message", [
    (("mesh.pp=2", "mesh.fsdp=4", "model.n_layers=8", "plan.stage_layers=3,4"),
     "plan.stage_layers='3,4' sums to 7 layers, but model.n_layers=8: the counts must add up"),
    (("mesh.pp=2", "mesh.fsdp=4", "model.n_layers=8", "plan.stage_layers=8,0"),
     "plan.stage_layers='8,0' leaves a stage empty"),
    (("mesh.pp=2", "mesh.fsdp=4", "plan.stage_layers=4,4,4"),
     r"names 3 stages, but the pipeline has 2 \(mesh.pp x virtual stages\): give 2 counts"),
    (("mesh.pp=2", "mesh.fsdp=4", "plan.stage_layers=four"),
     "give 'auto' or 2 comma-separated layer counts, one per pipeline stage"),
    (("mesh.pp=1", "mesh.fsdp=8", "plan.stage_layers=4,4"), "but mesh.pp=1"),
    (("mesh.pp=2", "mesh.fsdp=4", "model.n_layers=1"),
     "model.n_layers=1 is fewer than the 2 pipeline stages"),
    (("mesh.pp=4", "mesh.fsdp=2", "plan.schedule=zb-h1", "plan.accumulate=2"),
     r"plan.schedule=zb-h1 needs at least as many micro-batches as pipeline stages: m=2 < p=4"),
    (("mesh.pp=2", "mesh.fsdp=4", "plan.schedule=zb-v", "plan.accumulate=2"),
     r"plan.schedule=zb-v needs at least twice as many micro-batches as pipeline devices"),
    (("mesh.pp=2", "mesh.fsdp=2", "mesh.sp=2", "data.seq_len=30"),
     "context parallelism cuts data.seq_len=30 into 2 x mesh.sp = 4 zig-zag chunks"),
    (("mesh.pp=2", "mesh.fsdp=4", "model.scan_layers=false"), "set model.scan_layers=true"),
])
def test_bad_stage_layouts_are_refused_before_anything_compiles(overrides, message):
    with pytest.raises(ValueError, match=message):
        plan.validate(tiny_config(*BASE, "mesh.tp=1", *overrides), 8)


SLOTS_16BIT = {
    "ZB-H1, one layer a stage": ("mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "mesh.fsdp=1",
                                 "plan.schedule=zb-h1", "plan.accumulate=2", "model.dim=96",
                                 "model.n_heads=6", "model.n_kv_heads=6", "model.ffn_dim=160",
                                 "data.seq_len=32", "data.batch_size=8"),
    "1F1B, two layers a stage, scores 70% of the residuals": (
        "mesh.dp=4", "mesh.pp=2", "mesh.tp=1", "mesh.fsdp=1", "plan.schedule=1f1b",
        "plan.accumulate=2", "model.dim=96", "model.n_heads=12", "model.n_kv_heads=1",
        "model.ffn_dim=224", "model.n_layers=4", "data.seq_len=96", "data.batch_size=16")}


@pytest.mark.parametrize("base", SLOTS_16BIT.values(), ids=SLOTS_16BIT)
def test_bf16_slots_hold_two_bytes_an_element(base):
    """XLA:CPU widens bf16 arithmetic to f32 but not the engine's slots: ZB-H1's residual,
    boundary and tape slots in bf16 compile to half their f32 bytes, and the planner's temp stays
    within 15% in both precisions (counted at 4 bytes, bf16 was 1.47x the compiled). The
    residuals the model keeps in fp32, the attention scores, stay fp32 in their slots: where
    they are most of a layer's residuals, halving every slot put the planner at 0.80 of the
    compiled bf16 temp (`pp.memory`)."""
    from jaxscale.analysis import validation
    temp = {}
    for p in ("fp32", "bf16"):
        cfg = tiny_config(*base, f"plan.precision={p}")
        temp[p] = inspect.report(cfg)["memory"]["temp"]
        assert planner.predict(cfg).memory.xla["temp"] / temp[p] - 1 == pytest.approx(
            0, abs=validation.TOLERANCE["temp"]), p
    assert temp["fp32"] - temp["bf16"] > 0.5e6         # the slots' halves, not only rounding
