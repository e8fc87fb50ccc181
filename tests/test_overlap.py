"""Collective matmul (jaxscale/strategies/overlap/collective_matmul.py) and plan.tp_overlap /
plan.xla_preset (jaxscale/strategies/overlap/__init__.py): the decompositions equal the plain
matmul, forward and backward; a TP+SP step with them equals the step without; its census shows ring
permutes in place of the block's all-gathers and reduce-scatters, as the formula says; bad plans are
refused by name; every XLA preset is accepted by the installed jaxlib and reaches the train step."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxscale import plan
from jaxscale.analysis import inspect
from jaxscale.axes import Rules
from jaxscale.data import Batches, load_corpus
from jaxscale.strategies import overlap
from jaxscale.strategies.overlap import collective_matmul as cm
from jaxscale.train.setup import build
from tests import numerics
from tests.helpers import tiny_config

TPSP = ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4", "plan.sequence_parallel=true",
        "model.n_kv_heads=4")
CM = "plan.tp_overlap=collective_matmul"


# ----------------------------------------------------------------------------- the functions
@pytest.mark.parametrize("shape, bidirectional", [((2, 4), False), ((1, 8), True)])
def test_collective_matmul_equals_plain_matmul(shape, bidirectional):
    mesh = jax.make_mesh(shape, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    k = jax.random.split(jax.random.key(0), 4)
    x_BTD, w_DF = jax.random.normal(k[0], (2, 16, 8)), jax.random.normal(k[1], (8, 16))
    h_BTF, w_FD = jax.random.normal(k[2], (2, 16, 16)), jax.random.normal(k[3], (16, 8))
    kw = dict(axis="tp", bidirectional=bidirectional)
    ag = jax.jit(jax.shard_map(partial(cm.allgather_matmul, "btd,df->btf", **kw), mesh=mesh,
                               in_specs=(P("dp", "tp"), P(None, "tp")),
                               out_specs=P("dp", None, "tp")))
    rs = jax.jit(jax.shard_map(partial(cm.matmul_reduce_scatter, "btf,fd->btd", **kw),
                               mesh=mesh, in_specs=(P("dp", None, "tp"), P("tp")),
                               out_specs=P("dp", "tp")))
    for fn, eq, a, b in ((ag, "btd,df->btf", x_BTD, w_DF), (rs, "btf,fd->btd", h_BTF, w_FD)):
        np.testing.assert_allclose(fn(a, b), jnp.einsum(eq, a, b), rtol=1e-5, atol=1e-5)
        loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))            # noqa: E731
        got = jax.grad(loss(fn), (0, 1))(a, b)
        want = jax.grad(loss(partial(jnp.einsum, eq)), (0, 1))(a, b)
        for g, r in zip(got, want):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
        # forward and backward move sequence chunks by permutes only
        text = jax.jit(jax.grad(loss(fn), (0, 1))).lower(a, b).compile().as_text()
        kinds = {c["kind"] for c in inspect.census(text, mesh)}
        assert kinds <= {"collective-permute", "all-reduce"}, kinds   # all-reduce: dW over dp
        assert "collective-permute" in kinds


def test_ring_split_covers_every_other_device():
    for t in range(1, 9):
        assert sum(cm.ring_split(t, False)) == sum(cm.ring_split(t, True)) == t - 1
        assert max(cm.ring_split(t, True)) == (t - 1 + 1) // 2


# ----------------------------------------------------------------------------- the plan
def _grads(cfg):
    setup = build(cfg)
    batch = Batches(load_corpus(cfg.data).train, cfg.data.batch_size, cfg.data.seq_len,
                    seed=0).device_batch(0, setup.batch_shardings())
    grads, loss, _ = setup.jit_grads()(setup.init_state().params, batch)
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def plain():
    return _grads(tiny_config(*TPSP))


@pytest.fixture(scope="module")
def overlapped():
    cfg = tiny_config(*TPSP, CM)
    return cfg, _grads(cfg), inspect.report(cfg)


def test_tp_sp_step_with_collective_matmul_equals_the_step_without(plain, overlapped):
    loss, grads = overlapped[1]
    assert loss == pytest.approx(plain[0], rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain[1])):
        assert np.abs(a - b).max() <= 1e-5 * (np.abs(b).max() + 1e-12)


def test_fsdp_with_collective_matmul_matches_one_device_and_the_formula():
    """FSDP + async TP (torchtitan's 2D plan): the weights gathered over fsdp inside the region,
    the ring over tp; 3 updates equal one device's, and the census is the formula row by row."""
    plan_ = ("mesh.dp=1", "mesh.fsdp=2", "mesh.tp=4", "plan.sequence_parallel=true",
             "model.n_kv_heads=4", CM)
    got = numerics.run(plan_)
    numerics.assert_matches(got, numerics.one_device("model.n_kv_heads=4"), numerics.FP32)
    cfg = tiny_config(*plan_)
    spec = plan.Spec.from_config(cfg, 8).with_(device_kind="cpu")
    rows = inspect.theory_vs_census(plan.collectives(spec),
                                    inspect.census(got.text, got.setup.placement.mesh))
    assert {tuple(r["axes"]) for r in rows} >= {("fsdp",), ("tp",)}
    for row in rows:
        assert row["census_bytes"] == pytest.approx(row["theory_bytes"], rel=1e-3), row


#: 6 heads over 2 kv heads (3 and 1 per tp rank), ffn 224, 5 layers, vocabulary 509
ODD = ("model.dim=96", "model.n_heads=6", "model.n_kv_heads=2", "model.ffn_dim=224",
       "model.n_layers=5", "model.vocab_size=509", "data.seq_len=64")


@pytest.mark.parametrize("model, layout, merged, tol", [
    (("model.moe_experts=4",), ("mesh.dp=1", "mesh.ep=2", "plan.context=ulysses"), ("ep", "sp"),
     numerics.MOE),
    ((), ("mesh.dp=2", "mesh.ep=1", "plan.context=ring"), ("dp", "sp"), numerics.FP32),
], ids=["MoE ep2 x sp2 x tp2 Ulysses", "dp2 x sp2 x tp2 ring"])
def test_the_region_reduces_block_weights_once_over_the_merged_axes(model, layout, merged, tol):
    """The collective matmul's region runs over the whole mesh: its transpose sums each block
    weight's gradient over every axis the weight is whole on (the data axes and sp) in one
    all-reduce, and the formula has that one row (not one over the data axes and another over
    sp). By hand, per layer the tp shards of q, k, v, o (D hd (2H + 2K) / tp fp32) and of a dense
    MLP's gate, up, down (3 D F / tp); a MoE layer's experts reduce in their own region. On the
    odd shapes, against one device."""
    got = numerics.run((*ODD, *model, *layout, "mesh.fsdp=1", "mesh.sp=2", "mesh.tp=2",
                        "plan.sequence_parallel=true", CM))
    numerics.assert_matches(got, numerics.one_device(*ODD, *model), tol)
    cfg = got.setup.cfg
    spec = plan.Spec.from_config(cfg, 8)
    census = inspect.census(got.text, got.setup.placement.mesh)
    rows = inspect.theory_vs_census(plan.collectives(spec), census)
    for row in rows:
        assert row["census_bytes"] == pytest.approx(row["theory_bytes"], rel=1e-3), row
    m = cfg.model
    per_layer = m.dim * m.hd * (2 * m.n_heads + 2 * m.n_kv_heads) // 2 * 4
    per_layer += 0 if m.moe_experts else 3 * m.dim * m.ffn_dim // 2 * 4
    (row,) = [r for r in rows if tuple(r["axes"]) == merged]
    assert row["census_bytes"] == row["theory_bytes"] == m.n_layers * per_layer


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_qat_operands_through_the_rings_match_one_device_and_the_formula(method):
    """QAT with collective matmul on fsdp2 x tp4: the rings carry 8-bit chunks (int8 with its
    per-token scales, s32 partial dots; fp8 e4m3 / e5m2 bytes), 3 updates equal one device's
    QAT (fp8 with its amax history), and the census is the formula row by row, permutes at
    fewer bytes than the unquantised rings."""
    plan_ = ("mesh.dp=1", "mesh.fsdp=2", "mesh.tp=4", "plan.sequence_parallel=true",
             "model.n_kv_heads=4", CM, f"plan.qat={method}")
    got = numerics.run(plan_)
    worst = numerics.assert_matches(
        got, numerics.one_device("model.n_kv_heads=4", f"plan.qat={method}"),
        {"int8": numerics.QAT_INT8, "fp8": numerics.QAT_FP8}[method])
    print(f"{method} QAT through the rings vs one device: {worst}")     # docs/overlap.md
    cfg = tiny_config(*plan_)
    spec = plan.Spec.from_config(cfg, 8).with_(device_kind="cpu")
    rows = inspect.theory_vs_census(plan.collectives(spec),
                                    inspect.census(got.text, got.setup.placement.mesh))
    for row in rows:
        assert row["census_bytes"] == pytest.approx(row["theory_bytes"], rel=1e-3), row
    (perm,) = [r for r in rows if r["kind"] == "collective-permute"]
    unquantised = overlap.collectives(spec.with_(qat="none"))[0].bytes
    assert perm["census_bytes"] < {"int8": 0.9, "fp8": 0.6}[method] * unquantised
    (ring,) = overlap.collectives(spec)
    assert ring.count == sum(c["count"] for c in inspect.census(
        got.text, got.setup.placement.mesh) if c["kind"] == "collective-permute")


def _count(rep, kind, axes=("tp",)):
    return sum(c["count"] for c in rep["collectives"]
               if c["kind"] == kind and tuple(c["axes"]) == axes)


def test_census_shows_permutes_in_place_of_the_block_gathers(overlapped):
    cfg, _, rep = overlapped
    t, L = cfg.mesh.tp, cfg.model.n_layers
    assert _count(rep, "all-gather") == 2          # the LM head's input, forward and backward
    # 10 rings per layer: 2 gathering (one per column group) + 2 scattering forward; backward
    # the 2 gathering again for dW, one reverse ring per group and one per row matmul
    assert _count(rep, "collective-permute") == 10 * (t - 1) * L
    for row in rep["theory"]:                      # every formula, the permutes' included
        assert row["ratio"] is not None and abs(row["ratio"] - 1) < 0.025, row
    spec = plan.Spec.from_config(cfg, 8)
    (perm,) = overlap.collectives(spec)
    assert perm.overlap and perm.count == _count(rep, "collective-permute")


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_bidirectional_with_remat_replays_the_o_ring_as_the_formula_says(remat):
    """Both policies replay the o ring: full remat recomputes o_proj, save_dots keeps the
    chunks' partial dots but not the ring's sum of them."""
    cfg = tiny_config(*TPSP, "plan.tp_overlap=collective_matmul_bidirectional",
                      f"plan.remat={remat}")
    rep = inspect.report(cfg)
    t, L = cfg.mesh.tp, cfg.model.n_layers
    assert _count(rep, "collective-permute") == (10 + 1) * (t - 1) * L
    (row,) = [r for r in rep["theory"] if r["kind"] == "collective-permute"]
    assert row["ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize("qat", ["none", "fp8"])
def test_a_split_schedules_w_pass_rings_are_the_formula(qat):
    """ZB-H1's W pass takes each weight's gradient through its own matmul's backward: a column
    site's ring gathers its input alone (5 rings for q, k, v, gate, up where the unsplit
    backward's 2 groups ran), and each row matmul's output-gradient ring runs again: per layer
    and micro-batch 3 + 2 rings beyond 1F1B's 10 (the all-to-alls XLA:CPU runs them as inside
    pipeline stages), and GSPMD's two gathers of the row output gradients from the tape
    (generated seeds 1017, 1031: the all-to-alls 0.67x, the gathers 0.17-0.20x of the compiled
    before)."""
    base = ("mesh.dp=2", "mesh.pp=2", "mesh.fsdp=1", "mesh.tp=2", "plan.sequence_parallel=true",
            CM, "plan.accumulate=2", f"plan.qat={qat}")
    rep = inspect.report(tiny_config(*base, "plan.schedule=zb-h1"))
    rows = {r["kind"]: r for r in rep["theory"] if r["axes"] == ["tp"]}
    for kind in ("all-to-all", "all-gather"):
        assert rows[kind]["census_bytes"] == rows[kind]["theory_bytes"]
    if qat == "none":               # 1F1B's 10 rings per layer and micro-batch, by the formula
        one_f = plan.Spec.from_config(tiny_config(*base, "plan.schedule=1f1b"), 8).with_(
            device_kind="cpu")
        (rings,) = [c for c in plan.collectives(one_f) if c.kind == "all-to-all"]
        assert rows["all-to-all"]["census_bytes"] == 1.5 * rings.bytes


@pytest.mark.parametrize("name", ["1f1b full remat", "zb-h1 int8"])
def test_a_pipeline_stages_rings_are_counted_op_by_op(name):
    """Ring all-to-alls per layer of each pipeline op (`stage_hlo`), by hand, and the census
    equal to the formula. 1F1B, tp4, full remat, stage ops of 2 layers: F runs the 2 input and 2
    row rings; B the 6 of an unsplit backward, the o ring replayed and, beside the weight
    gradients' rings, the 2 input rings its replay runs in the stage's own layer loop (9, where
    one-layer ops share them: 7). ZB-H1 with int8 QAT: F the int8 input rings (chunk and scales,
    2 permutes a hop) and the s32 row rings, B the input and row gradients' 4, W the plain
    rings of each weight's own backward, 5 column sites and 2 row gradients again, as in fp32
    (generated seeds 1160, 1190, 1209, 1225, 1249: 1.18-1.67x the formula before)."""
    from jaxscale.strategies.pp import program
    from tests import stage_hlo
    if name == "1f1b full remat":
        over, per_layer = (*TPSP, "mesh.dp=1", "mesh.pp=2", "plan.remat=full",
                           "model.n_layers=4"), {"F": 4, "B": 9}
    else:
        over, per_layer = ("mesh.dp=2", "mesh.pp=2", "mesh.fsdp=1", "mesh.tp=2",
                           "plan.sequence_parallel=true", "plan.qat=int8",
                           "plan.schedule=zb-h1"), {"F": 6, "B": 4, "W": 7}
    cfg = tiny_config(*over, CM, "plan.accumulate=2")
    setup = build(cfg)
    text = setup.lower_train_step().compile().as_text()
    spec, mesh = setup.placement.spec, setup.placement.mesh
    hops = cfg.mesh.tp - 1
    for (kind, _, n, *_), op in stage_hlo.branches(text, mesh, program.program_for(spec)).items():
        assert op.sent("all-to-all", ("tp",))[0] == per_layer[kind] * hops * n, (kind, n)
    census = inspect.census(text, mesh, plan.branch_share(spec))
    rows = inspect.theory_vs_census(plan.collectives(spec.with_(device_kind="cpu")), census)
    (row,) = [r for r in rows if r["kind"] == "all-to-all" and r["axes"] == ["tp"]]
    assert row["census_bytes"] == row["theory_bytes"]


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("overrides, msg", [
    (("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", CM), "mesh.tp=1: set mesh.tp > 1"),
    (("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4", CM), "set plan.sequence_parallel=true"),
])
def test_bad_plans_are_refused_by_name(overrides, msg):
    errs = plan.Spec.from_config(tiny_config(*overrides, "model.n_kv_heads=4"), 8).problems()
    assert any(msg in e for e in errs), errs


def test_bad_option_values_and_a_second_projection_are_refused():
    spec = plan.Spec.from_config(tiny_config(*TPSP), 8)
    errs = spec.with_(tp_overlap="ring", xla_preset="fast").problems()
    assert any("plan.tp_overlap='ring': valid are none" in e for e in errs), errs
    assert any("plan.xla_preset='fast': valid are default" in e for e in errs), errs
    taken = Rules().set_seam("projection", "int8", by="plan.qat=int8")
    with pytest.raises(ValueError, match="plan.tp_overlap=collective_matmul and plan.qat=int8 "
                                         "both replace the model's weight matmuls"):
        overlap.rules(spec.with_(tp_overlap="collective_matmul"), taken)
    # with QAT the collective matmul is the one projection, on QAT's operands
    both = spec.with_(tp_overlap="collective_matmul", qat="fp8")
    assert both.problems() == []
    assert both.rules.seams["projection"] == both.rules.seams["columns"] == "collective_matmul+fp8"


# ----------------------------------------------------------------------------- XLA presets
def test_every_xla_preset_is_accepted_by_the_installed_jaxlib():
    lowered = jax.jit(lambda a: a @ a).lower(jnp.ones((4, 4)))
    for name in overlap.XLA_PRESETS:
        lowered.compile(compiler_options=overlap.compiler_options(name))
    assert "xla_cpu_enable_concurrency_optimized_scheduler" not in overlap.gpu_only(
        "latency_hiding")
    with pytest.raises(Exception, match="No such compile option"):
        lowered.compile(compiler_options={"xla_gpu_no_such_option": True})


def test_the_preset_reaches_the_train_step(monkeypatch):
    monkeypatch.setitem(overlap.XLA_PRESETS, "default", {"xla_gpu_no_such_option": True})
    setup = build(tiny_config("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", "model.n_layers=1"))
    with pytest.raises(Exception, match="No such compile option"):
        setup.lower_train_step().compile()


# ----------------------------------------------------------------------------- schedule reader
_SCHEDULED = """HloModule m, is_scheduled=true

%fused (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %ags = (f32[4,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%a), channel_id=1, \
replica_groups={{0,1}}, dimensions={0}
  %mm = f32[4,4]{1,0} fusion(%b, %b), kind=kOutput, calls=%fused
  %agd = f32[8,4]{1,0} all-gather-done(%ags)
  %cp = f32[4,4]{1,0} collective-permute(%mm), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %mm2 = f32[4,4]{1,0} fusion(%b, %a), kind=kOutput, calls=%fused
  %mm3 = f32[4,4]{1,0} fusion(%cp, %b), kind=kOutput, calls=%fused
  %cp2 = f32[4,4]{1,0} collective-permute(%mm3), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %mm4 = f32[4,4]{1,0} fusion(%cp2, %agd), kind=kOutput, calls=%fused
}
"""


def test_schedule_windows_of_async_and_synchronous_collectives():
    from jaxscale.analysis import windows
    ws = {w.name: w for w in windows.windows(_SCHEDULED)}
    assert set(ws) == {"ags", "cp", "cp2"}
    mm = 2 * 4 * 4 * 4
    # async: the matmul between start and done; sync: the one between producer and consumer
    assert ws["ags"].asynchronous and ws["ags"].window_flops == mm and ws["ags"].bytes == 128
    assert not ws["cp"].asynchronous and (ws["cp"].window_ops, ws["cp"].window_flops) == (1, mm)
    # nothing scheduled between mm3 and mm4, though mm2 was independent of cp2
    assert ws["cp2"].window_ops == 0 and ws["cp2"].independent_flops == mm
    s = windows.summary(list(ws.values()))["all"]
    assert s["covered"] == pytest.approx((128 + 64) / (128 + 64 + 64))
    assert s["coverable"] == 1.0 and s["async"] == 1
