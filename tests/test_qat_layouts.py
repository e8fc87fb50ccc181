"""8-bit QAT across layouts (`jaxscale/strategies/qat/`): fp8's delayed scaling under gradient
accumulation and tensor parallelism, and int8's weights quantised on their shards before fsdp's
gathers (the census row by row against `qat.weight_gathers` and `qat.collectives`).

fp8's rule: a step's amaxes are the largest each slot saw over the step's micro-batches, on
every layout (the data region's, the pipeline's and the plain step's), rolled into the history
once per step; the first step (no history) scales each micro-batch by its own amaxes, just in
time; from then on the scales are the history's, whatever the number of micro-batches."""
import dataclasses
import re

import jax
import numpy as np
import pytest

from jaxscale import plan as plan_lib
from jaxscale.analysis import hlo, inspect
from jaxscale.data import Batches, load_corpus
from jaxscale.plan import Spec
from jaxscale.strategies import fsdp, qat
from jaxscale.strategies.qat import numerics as qn
from jaxscale.train import disk
from jaxscale.train.setup import build
from tests import numerics
from tests.helpers import MESH_1, tiny_config

FP8_ACC = ("plan.qat=fp8", "plan.accumulate=2", "data.batch_size=16")
DP8 = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1")
LAYOUTS = {"dp8": DP8, "pp2 x fsdp4": ("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1"),
           "dp2 x fsdp2 x tp2": ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2")}


def first_amaxes(*overrides, devices=None):
    """The amaxes the first step (from the seeded initialisation, on batch 0) rolled in:
    [layers, slots]."""
    cfg = tiny_config(*overrides)
    setup = build(cfg, devices)
    batches = Batches(load_corpus(cfg.data).train, cfg.data.batch_size, cfg.data.seq_len, seed=0)
    state, _ = setup.lower_train_step().compile()(
        setup.init_state(), batches.device_batch(0, setup.batch_shardings()))
    return np.asarray(jax.device_get(state.quant["amax_history"]))[..., 0]


@pytest.fixture(scope="module")
def one_device_amaxes():
    return first_amaxes(*MESH_1, *FP8_ACC, devices=jax.devices()[:1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_history_is_one_devices_on_every_layout(layout, one_device_amaxes):
    """The first step's recorded amaxes (x, w and g of every layer) equal one device's with
    accumulation: the same maxima of the same values (fp32 reduction order moves the
    activations and gradients by ulps). The data region once dropped them (histories left at
    zero, dp8: every step scaled just in time), and tensor parallelism's column region recorded
    its weights' shard maxima (1.8-4.3% below the weight's, dp2 x fsdp2 x tp2), and the
    output gradients' in the region's units (8x one device's on dp8: a history restored onto
    another layout scaled its gradients 8x off). The output gradients come out of fp8 dots
    upstream: a rounding flip there moves them within QAT_FP8's gradient bound (measured
    1.7e-4 relative, a key's gradient on tp2)."""
    got = first_amaxes(*LAYOUTS[layout], *FP8_ACC)
    assert np.all(one_device_amaxes > 0)
    fwd = [i for i, s in enumerate(qn.SLOTS) if s[0] in "xw"]
    bwd = [i for i, s in enumerate(qn.SLOTS) if s[0] == "g"]
    np.testing.assert_allclose(got[:, fwd], one_device_amaxes[:, fwd], rtol=1e-5)
    np.testing.assert_allclose(got[:, bwd], one_device_amaxes[:, bwd],
                               rtol=numerics.QAT_FP8.grads)


@pytest.mark.parametrize("mesh", [DP8, ("mesh.dp=2", "mesh.ep=2", "mesh.fsdp=2", "mesh.tp=1")])
def test_fp8_history_of_the_experts_is_one_devices(mesh):
    """The experts' grouped matmuls record the MLP slots' amaxes from inside the dispatch's
    region, maxima over all its devices: its transpose passes them out as they are. Averaging
    them there, as a region summing its replicated input's cotangent needs, recorded 1/8 of
    them on dp8 (1/n of the region's devices), which scaled the next step's expert operands
    and gradients 8x too fine (saturated: gradients 0.99 of their largest off)."""
    moe = ("model.moe_experts=4", "plan.qat=fp8", "data.batch_size=16")
    want = first_amaxes(*MESH_1, *moe, devices=jax.devices()[:1])
    got = first_amaxes(*mesh, *moe)
    np.testing.assert_allclose(got, want, rtol=numerics.QAT_FP8.grads)


def test_fp8_amaxes_leave_the_data_region_as_one_array():
    """In a data region (dp8 with 2 micro-batches) the step's amaxes are combined over dp as one
    [layers, slots] fp32 all-reduce(max), which the formula counts (generated seed 1013: 360 B
    beside the router's statistics, the dp row 0.40 of the compiled without it)."""
    cfg = tiny_config(*DP8, *FP8_ACC)
    setup = build(cfg)
    text = setup.lower_train_step().compile().as_text()
    L = cfg.model.n_layers
    assert re.search(rf"= f32\[{L},{len(qn.SLOTS)}\]\S* all-reduce", text)
    rows = [c for c in qat.collectives(setup.placement.spec) if c.axes == ("dp",)]
    assert [(c.kind, c.bytes) for c in rows] == [("all-reduce", 4 * L * len(qn.SLOTS))]


def test_fp8_zero_bubble_w_pass_gathers_are_the_formula():
    """Megatron SP with fp8 QAT under ZB-H1: W's replayed forward gathers each column group's
    input over tp beside the row output gradients it gathers from the tape: four all-gathers
    per layer and micro-batch beyond 1F1B's, the formula's (generated seed 1224: 0.81 of the
    compiled with two)."""
    cfg = tiny_config("mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "mesh.fsdp=1",
                      "plan.sequence_parallel=true", "plan.qat=fp8", "plan.schedule=zb-h1",
                      "plan.accumulate=2")
    rows = {(r["kind"], tuple(r["axes"])): r for r in inspect.report(cfg)["theory"]}
    gather = rows[("all-gather", ("tp",))]
    assert gather["census_bytes"] == gather["theory_bytes"]


@pytest.mark.parametrize("layout,shared", [("dp8", FP8_ACC),
                                           ("dp2 x fsdp2 x tp2", ("plan.qat=fp8",))])
def test_fp8_matches_one_device(layout, shared):
    """3 updates of fp8 QAT against one device's: with 2 micro-batches on the data region's
    layout (dp8: the replicated gradients reduced once per step), and under tensor parallelism
    (its column region). (pp2 x fsdp4 with 2 micro-batches: `test_pipeline_families.py`.)
    Measured: dp8 grads 2.8e-3, weights 0.38 lr at most and 2.7e-4 lr on average (with the
    histories dropped: 0.37, 2.7 and 2.7e-2); dp2 x fsdp2 x tp2 4.2e-3, 0.33 and 1.9e-4 (with
    the column region's shard maxima: 0.17, 5.0 and 6.1e-2)."""
    got = numerics.run((*LAYOUTS[layout], *shared))
    numerics.assert_matches(got, numerics.one_device(*shared), numerics.QAT_FP8)


def test_fp8_accumulation_changes_only_the_first_steps_scales():
    """One device, one step on the same batch with 1 and 2 micro-batches: from a state with a
    history the scales are the history's and the gradients agree within fp8's rounding flips
    (2^-6 of a leaf's largest); from the first state (no history) each micro-batch scales by
    its own amaxes, a different rounding of every element (measured 0.06 of a leaf's largest,
    beyond what flips explain: e5m2 has 2 mantissa bits)."""
    cfg = {k: tiny_config(*MESH_1, "plan.qat=fp8", "data.batch_size=16", f"plan.accumulate={k}")
           for k in (1, 2)}
    setups = {k: build(c, jax.devices()[:1], with_grads=True) for k, c in cfg.items()}
    steps = {k: s.lower_train_step().compile() for k, s in setups.items()}
    batches = Batches(load_corpus(cfg[1].data).train, 16, cfg[1].data.seq_len, seed=0)
    fresh = setups[1].init_state()
    warmed, _ = steps[1](jax.tree.map(np.asarray, jax.device_get(fresh)),
                         batches.device_batch(0, setups[1].batch_shardings()))
    host = {"fresh": jax.device_get(fresh), "warmed": jax.device_get(warmed)}
    assert np.all(host["warmed"].quant["amax_history"][..., 0] > 0)

    def grads(k, state):
        st = jax.device_put(dataclasses.replace(state), setups[k].state_shardings)
        m = steps[k](st, batches.device_batch(1, setups[k].batch_shardings()))[1]
        return disk.to_disk(jax.device_get(m["grads"]), cfg[k].model.vocab_size, None)

    def worst(state):
        a, b = grads(1, state), grads(2, state)
        return max(float(np.abs(x - y).max() / np.abs(x).max())
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert worst(host["warmed"]) < numerics.QAT_FP8.grads
    assert worst(host["fresh"]) > numerics.QAT_FP8.grads


# ------------------------------------------------------------------------------------------
# int8: the weights quantised on their shards, gathered in 8 bits
# ------------------------------------------------------------------------------------------
INT8 = {   # name -> overrides: each census row equals the formula
    "dp2 x fsdp2 x tp2 remat=full": ("plan.qat=int8", "plan.remat=full"),
    "fsdp8 save_dots": ("plan.qat=int8", "mesh.dp=1", "mesh.fsdp=8", "mesh.tp=1",
                        "plan.remat=save_dots"),
    "dp2 x fsdp2 x tp2 ZeRO-3": ("plan.qat=int8", "plan.zero=3"),
    "dp2 x tp4 ZeRO-3": ("plan.qat=int8", "mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4", "plan.zero=3"),
}


def census_rows(cfg, text, mesh):
    spec = Spec.from_config(cfg, 8)
    return spec, inspect.theory_vs_census(plan_lib.collectives(spec),
                                          inspect.census(text, mesh))


def gathers_by_dtype(text) -> dict:
    """Bytes of every all-gather of the compiled step by element type, loop trips included."""
    mod = hlo.Module(text)
    out: dict = {}
    for ins in mod.instrs:
        if ins.opcode.startswith("all-gather"):
            dtype, dims = hlo.shapes(ins.type_str)[0]
            size = {"s8": 1, "f16": 2, "f32": 4}[dtype]
            out[dtype] = out.get(dtype, 0) + int(np.prod(dims)) * size \
                * mod.runs.get(ins.computation, 0)
    return out


@pytest.mark.parametrize("name", INT8)
def test_int8_gathers_are_the_formula_row_by_row(name):
    """Every census row equals the formula's (the fsdp gathers per weight: int8 values, and
    fp32 scales where the gather axes split a channel dimension, in each forward run; the
    compute dtype for the straight-through backward; none quantised where the weight reaches
    the projection gathered). By hand, dp2 x fsdp2 x tp2 with remat=full: the replay of
    wo's matmul regathers its int8 values and scales, the column weights are gathered in fp32
    before tensor parallelism's region, so the 8-bit gathers are wo's and w_down's tp shards
    per layer, wo's once more (and their 128 fp32 scales each)."""
    cfg = tiny_config(*INT8[name], "plan.check_memory=false")
    setup = build(cfg)
    text = setup.lower_train_step().compile().as_text()
    spec, rows = census_rows(cfg, text, setup.placement.mesh)
    for r in rows:
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=1e-4, abs=8), (name, r)
    s8 = gathers_by_dtype(text).get("s8", 0)
    L, d, f = cfg.model.n_layers, cfg.model.dim, cfg.model.ffn_dim
    if name == "dp2 x fsdp2 x tp2 remat=full":
        wo, w_down = d * d // 2, f // 2 * d            # tp2 halves heads and mlp
        assert s8 == L * (2 * wo + w_down)             # wo, w_down; wo again in the replay
        (least,) = [r for r in rows if r["kind"] == "all-gather"]
        assert least["minimum_bytes"] == least["theory_bytes"] - L * (wo + 4 * d)
    elif name == "dp2 x tp4 ZeRO-3":
        assert s8 == 0                 # dp splits the stored layers: each layer gathered whole
    else:
        assert s8 > 0


def test_fp8_gathers_e4m3_in_the_forward_and_the_backward():
    """fp8 under GSPMD casts each shard to e4m3 before fsdp's gathers (`on_shards`), and the
    backward keeps that copy: every census row equals the formula, and the e4m3 gathers (f16
    on XLA:CPU) are, by hand on dp2 x fsdp2 x tp2, each layer's seven tp shards (wq 128 x 4
    heads x 16, wk and wv 2 heads each, wo as wq, gate, up and down 128 x 192) twice at 2
    bytes. Before, XLA chose per weight where to cast: 0.6 of the formula."""
    cfg = tiny_config("plan.qat=fp8", "plan.check_memory=false")
    setup = build(cfg)
    text = setup.lower_train_step().compile().as_text()
    _, rows = census_rows(cfg, text, setup.placement.mesh)
    for r in rows:
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=1e-3, abs=8), r
    layer = 128 * 16 * (4 + 2 + 2 + 4) + 3 * 128 * 192
    assert gathers_by_dtype(text)["f16"] == cfg.model.n_layers * 2 * 2 * layer


def test_weight_gathers_follow_the_plan():
    """The formula's choices: 8-bit forward gathers for int8 under GSPMD and under collective
    matmul, e4m3 both ways for fp8, none for the experts (the grouped seam)."""
    def gathers(*ov):
        spec = Spec.from_config(tiny_config(*ov), 8)
        from jaxscale.strategies.tables.params import leaves
        return {leaf.path: qat.weight_gathers(spec, leaf) for leaf in leaves(spec.model)
                if leaf.path.split("/")[-1] in qat.QUANTISED_SITES}
    int8 = gathers("plan.qat=int8")
    wq, wo = int8["layers/attn/wq"], int8["layers/attn/wo"]
    L, d, hd = 2, 128, 16
    assert wq == (L * d * 4 * hd, 4 * L * d * 4 * hd, 1, 1, 4 * L * d * 4 * hd)   # tp2: 4 heads
    assert wo == (L * d * 4 * hd + 4 * L * d, 4 * L * d * 4 * hd, 2, 1, 4 * L * d * 4 * hd)
    fp8 = gathers("plan.qat=fp8")           # e4m3 both ways, carried in f16 by XLA:CPU
    assert fp8["layers/attn/wq"] == (2 * L * d * 4 * hd,) * 2 + (1, 1, 2 * L * d * 4 * hd)
    moe = gathers("plan.qat=int8", "model.moe_experts=4", "mesh.ep=2", "mesh.dp=1")
    assert moe["layers/mlp/w_gate"] is None and moe["layers/attn/wq"] is not None
    fp32 = Spec.from_config(tiny_config(), 8)
    assert sum(c.bytes for c in fsdp.collectives(Spec.from_config(tiny_config("plan.qat=int8"), 8))
               ) < sum(c.bytes for c in fsdp.collectives(fp32))


def test_int8_scales_constrained_like_their_weight():
    """`on_shards` lays the scales out as the weight's channels (its contracted dimensions
    whole): the int8 matmul's output equals the unconstrained one's."""
    import jax.numpy as jnp
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 32)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(32, 4, 8)), jnp.float32)
    eq = "btd,dhk->bthk"
    np.testing.assert_array_equal(qn.int8_matmul(eq, x, w),
                                  qn.int8_matmul(eq, x, w, qn.int8_weight(eq, w)))
