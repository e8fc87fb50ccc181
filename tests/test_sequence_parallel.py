"""Sequence and context parallelism in the model: Megatron SP over tp, ring / Ulysses / all-gather
attention over sp, alone and with dp, fsdp, tp, remat and accumulation, give one device's losses
and gradients; their collectives are the planner's; bad plans are refused by name.
(The attention functions themselves: tests/test_context_attention.py.)"""
import pytest

from jaxscale import plan, planner
from jaxscale.analysis import hlo, hlo_flops, inspect, validation
from tests import numerics
from tests.helpers import tiny_config

KV8 = ("model.n_kv_heads=8",)
PLANS = {
    "ring sp8": ("mesh.dp=1", "mesh.fsdp=1", "mesh.sp=8", "mesh.tp=1", "plan.context=ring"),
    "ring dp2 sp2 tp2 zero1": ("mesh.dp=2", "mesh.fsdp=1", "mesh.sp=2", "mesh.tp=2",
                               "plan.context=ring", "plan.zero=1"),
    "ring+megatron sp2 tp4 remat": ("mesh.dp=1", "mesh.fsdp=1", "mesh.sp=2", "mesh.tp=4",
                                    "plan.context=ring", "plan.sequence_parallel=true",
                                    "plan.remat=full"),
    "ulysses fsdp2 sp4": ("mesh.dp=1", "mesh.fsdp=2", "mesh.sp=4", "mesh.tp=1",
                          "plan.context=ulysses"),
    "allgather dp2 sp4 acc2": ("mesh.dp=2", "mesh.fsdp=1", "mesh.sp=4", "mesh.tp=1",
                               "plan.context=allgather", "plan.accumulate=2"),
}


@pytest.fixture(scope="module")
def reference():
    return numerics.one_device(*KV8)


MEGATRON_SP = ("mesh.dp=1", "mesh.fsdp=2", "mesh.tp=4", "plan.sequence_parallel=true")


@pytest.mark.parametrize("name", [n for n in PLANS if n != "ring sp8"])
def test_plan_matches_single_device(name, reference):
    """(Megatron SP alone: its numerics are those of the ring+megatron plan, its census below;
    ring over all 8 devices: the bf16 test below.)"""
    numerics.assert_matches(numerics.run((*PLANS[name], *KV8)), reference)


def test_bf16_ring_tracks_one_bf16_device():
    bf16 = ("plan.precision=bf16", *KV8)
    numerics.assert_matches(numerics.run((*PLANS["ring sp8"], *bf16)),
                            numerics.one_device(*bf16), numerics.BF16)


@pytest.mark.parametrize("name, kind, per_layer", [
    ("ring dp2 sp2 tp2 zero1", "collective-permute", 3),       # 3 (sp - 1) K/V block hops per layer
    ("ulysses fsdp2 sp4", "all-to-all", 8),              # q, k, v, out; forward and backward
    ("allgather dp2 sp4 acc2", "all-gather", 1),         # and one reduce-scatter of dK/dV
])
def test_census_matches_the_planner(name, kind, per_layer):
    cfg = tiny_config(*PLANS[name], *KV8)
    rep = inspect.report(cfg)
    cmp = validation.compare(planner.predict(cfg), rep, backend="cpu")
    for r in cmp["collectives"]:
        assert r["ratio"] is not None and abs(r["ratio"] - 1) <= 0.02, r
    sp, L, k = cfg.mesh.sp, cfg.model.n_layers, cfg.plan.accumulate
    rows = [c for c in rep["collectives"] if c["kind"] == kind and c["axes"] == ["sp"]]
    hops = (sp - 1) if kind == "collective-permute" else 1
    assert sum(c["count"] for c in rows) == per_layer * hops * L * k, rows


def test_bf16_megatron_sp_with_micro_batches_compiles_and_moves_its_formula():
    """XLA:CPU widens 16-bit reductions to f32 and aborted on SP's reduce-scatters inside the
    accumulation loop (their reducer ends in a copy): they are summed in f32 before the pass
    (`tp.seq`), so the plan compiles, its tp collectives the formula's at 4 bytes."""
    cfg = tiny_config("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4", "plan.sequence_parallel=true",
                      "plan.precision=bf16", "plan.accumulate=2", *KV8)
    rep = inspect.report(cfg)
    cmp = validation.compare(planner.predict(cfg), rep, backend="cpu")
    for r in cmp["collectives"]:
        assert r["ratio"] is not None and abs(r["ratio"] - 1) <= 0.02, r
    assert any(c["kind"] == "reduce-scatter" and c["axes"] == ["tp"]
               for c in rep["collectives"])


def test_megatron_sp_turns_tp_all_reduces_into_gathers_and_shrinks_temp():
    tp = tiny_config("mesh.dp=1", "mesh.fsdp=2", "mesh.tp=4", *KV8)
    sp = tiny_config(*MEGATRON_SP, *KV8)
    a, b = inspect.report(tp), inspect.report(sp)
    gathers = lambda rep: sum(c["count"] for c in rep["collectives"]  # noqa: E731
                              if c["kind"] == "all-gather" and c["axes"] == ["tp"])
    assert gathers(a) == 0 and gathers(b) == 6 * sp.model.n_layers + 2
    assert b["memory"]["temp"] < a["memory"]["temp"]
    pa, pb = planner.predict(tp).memory, planner.predict(sp).memory
    assert pb.activations < pa.activations


# ----------------------------------------------------------------------------- odd shapes
#: 6 heads over 2 kv heads (3 and 1 per tp rank: sp=2 divides neither), ffn 224, 5 layers (uneven
#: pipeline stages), vocabulary 509 (padded to 510 for tp)
ODD = ("model.dim=96", "model.n_heads=6", "model.n_kv_heads=2", "model.ffn_dim=224",
       "model.n_layers=5", "model.vocab_size=509", "data.seq_len=64")
#: the residual stream split over (sp, tp), or inside a manual region (accumulation's data
#: region, the pipeline's stages): where GSPMD gathered row-parallel output gradients twice, or
#: moved fsdp's weights onto sp (`strategies/tp/rows.py`; under save_dots GSPMD's row matmuls
#: with their output gradient gathered once)
STREAM = {
    "ring fsdp2 x sp2 x tp2": ("mesh.dp=1", "mesh.fsdp=2", "mesh.sp=2", "plan.context=ring"),
    "ring dp2 x sp2 x tp2 acc2": ("mesh.dp=2", "mesh.fsdp=1", "mesh.sp=2", "plan.context=ring",
                                  "plan.accumulate=2"),
    "ring dp2 x sp2 x tp2 acc2 save_dots": ("mesh.dp=2", "mesh.fsdp=1", "mesh.sp=2",
                                            "plan.context=ring", "plan.accumulate=2",
                                            "plan.remat=save_dots"),
    "Ulysses dp2 x sp2 x tp2": ("mesh.dp=2", "mesh.fsdp=1", "mesh.sp=2", "plan.context=ulysses"),
    "ring pp2 x sp2 x tp2 acc2": ("mesh.dp=1", "mesh.fsdp=1", "mesh.pp=2", "mesh.sp=2",
                                  "plan.context=ring", "plan.accumulate=2"),
    "ring pp2 x sp2 x tp2 ZB-V": ("mesh.dp=1", "mesh.fsdp=1", "mesh.pp=2", "mesh.sp=2",
                                  "plan.context=ring", "plan.accumulate=4", "plan.schedule=zb-v"),
}


@pytest.fixture(scope="module")
def odd_reference():
    return numerics.one_device(*ODD)


@pytest.mark.parametrize("name", STREAM)
def test_split_stream_matches_one_device_and_its_formula(name, odd_reference):
    """Megatron SP with context parallelism on the odd shapes: one device's numerics, the census
    equal to the formula row by row, and by hand from the shapes the tp all-gathers (per layer
    and micro-batch the two norm outputs forward, the two row output gradients and the two norm
    outputs again backward; per micro-batch the head's input and the embedding's gradient;
    ZB-V's W gathers the two row output gradients again from its tape) and Ulysses' all-to-alls
    (per layer 4 q and 2 kv head slots a token for 3 and 1 heads, each way, forward and
    backward)."""
    got = numerics.run((*ODD, *STREAM[name], "mesh.tp=2", "plan.sequence_parallel=true"))
    numerics.assert_matches(got, odd_reference)
    cfg = got.setup.cfg
    spec = plan.Spec.from_config(cfg, 8)
    rows = inspect.census(got.text, got.setup.placement.mesh, plan.branch_share(spec))
    for r in inspect.theory_vs_census(plan.collectives(spec), rows):     # (a 4-byte token count
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], abs=4), r  # may ride a tuple)
    m, msh, k = cfg.model, cfg.mesh, cfg.plan.accumulate
    mb = cfg.data.batch_size // k // (msh.dp * msh.fsdp)       # sequences a device holds
    tokens = mb * cfg.data.seq_len // msh.sp
    per_layer = 6 + 2 * (cfg.plan.schedule == "zb-v")
    gathers = (per_layer * m.n_layers + 2) * k / msh.pp      # averaged over the pp devices
    got_gathers = [c for c in rows if c["kind"] == "all-gather" and c["axes"] == ["tp"]]
    assert [c["bytes"] for c in got_gathers] == [gathers * tokens * m.dim * 4]
    if cfg.plan.context == "ulysses":
        a2a = [c for c in rows if c["kind"] == "all-to-all"]
        assert [c["bytes"] for c in a2a] == [m.n_layers * k * 2 * tokens * (2 * 4 + 2 * 2)
                                             * m.hd * 4]
        # the zero heads' attention too: 4 heads' scores and outputs a device for 3
        flops = hlo_flops.dot_flops(hlo.Module(got.text, plan.branch_share(spec)))
        assert planner.predict(cfg).flops.per_device == pytest.approx(flops, rel=1e-9)


@pytest.mark.parametrize("overrides, msg", [
    (("mesh.dp=1", "mesh.fsdp=8", "mesh.tp=1", "plan.sequence_parallel=true"),
     "plan.sequence_parallel=true splits the residual stream over mesh.tp, but mesh.tp=1"),
    (("mesh.dp=1", "mesh.fsdp=2", "mesh.sp=4", "mesh.tp=1", "data.seq_len=36"),
     "cuts data.seq_len=36 into 2 x mesh.sp = 8 zig-zag chunks: use a multiple of 8"),
    (("mesh.dp=1", "mesh.fsdp=4", "mesh.sp=2", "mesh.tp=1", "plan.context=striped"),
     "plan.context"),
])
def test_bad_plans_are_refused_by_name(overrides, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        plan.validate(tiny_config(*overrides), 8)
