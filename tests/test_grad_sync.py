"""Gradient synchronisation once per step (`plan.grad_sync`, `strategies.dp`).

With `plan.accumulate=4` the replicated axes' gradient bytes per step are those of one
micro-batch (the reduction runs once, after the accumulation), the losses and gradients are the
per-micro-batch mode's, the census is the formula row by row, and the once-per-step mode's
whole accumulator shows in the compiled temp as the planner predicts.
"""
import math

import jax
import pytest

from jaxscale import plan as plan_lib
from jaxscale.analysis import hlo, inspect
from jaxscale.planner import memory as planner_memory
from jaxscale.train.setup import build
from tests import numerics
from tests.helpers import tiny_config

DP8 = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1")
HSDP = ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2")
ACC4 = ("plan.accumulate=4", "data.batch_size=32")
PRECISION = ("plan.precision=bf16",)


def _rows(text, cfg):
    """The census of a compiled step beside its formula, by (kind, axes)."""
    setup_spec = plan_lib.Spec.from_config(cfg, 8).with_(device_kind="cpu")
    mesh = plan_lib.place(cfg, None).mesh
    observed = inspect.census(text, mesh)
    return {(r["kind"], tuple(r["axes"])): r
            for r in inspect.theory_vs_census(plan_lib.collectives(setup_spec), observed)}


@pytest.fixture(scope="module", params=[DP8, HSDP], ids=["dp8", "dp2xfsdp2xtp2"])
def modes(request):
    """The plan with 4 micro-batches reduced once per step (auto) and per micro-batch, and the
    compiled step of one micro-batch."""
    plan = request.param
    auto = numerics.run((*plan, *ACC4))
    micro = numerics.run((*plan, *ACC4, "plan.grad_sync=microbatch"))
    one_cfg = tiny_config(*plan)
    one = build(one_cfg).lower_train_step().compile().as_text()
    return plan, auto, micro, one, one_cfg


def test_losses_and_gradients_equal_the_per_micro_batch_modes(modes):
    _, auto, micro, _, _ = modes
    numerics.assert_matches(auto, micro, numerics.FP32)


def _runs_over_dp(traj) -> list[float]:
    """How many times per step each compiled all-reduce whose group spans dp runs (the HLO's
    loop trip counts: a reduction inside the micro-batch loop runs once per micro-batch)."""
    mod = hlo.Module(traj.text)
    mesh = traj.setup.placement.mesh
    out = []
    for ins in mod.instrs:
        groups = hlo.replica_groups(ins.rest) if ins.opcode.startswith("all-reduce") else None
        if groups and len(groups[0]) > 1 and "dp" in inspect.axes_of_group(groups[0], mesh):
            out.append(mod.runs.get(ins.computation, 0.0))
    return out


def test_the_replicated_reduction_runs_once_after_the_micro_batch_loop(modes):
    """Where the reduction runs, read from the program (not from the formula, which follows
    `sync_axes` whatever it says): once per step every reduction over dp sits outside the
    4-micro-batch loop; per micro-batch each runs 4 times (8 inside the 2-layer loop)."""
    _, auto, micro, _, _ = modes
    once, per_micro = _runs_over_dp(auto), _runs_over_dp(micro)
    assert once and set(once) == {1.0}, once
    assert per_micro and set(per_micro) <= {4.0, 8.0} and 4.0 in per_micro, per_micro


def _over_dp(rows) -> float:
    """Census bytes of the reductions whose group includes dp (the replicated axis)."""
    return sum(r["census_bytes"] for (kind, axes), r in rows.items()
               if kind == "all-reduce" and "dp" in axes)


def test_replicated_axis_bytes_per_step_are_one_micro_batchs(modes):
    """Once per step, dp carries each device's gradient shard once (fp32, as the state lays
    the parameters out: read from the shardings, not from the formula) and the loss and token
    count (8 bytes): no more than one micro-batch's GSPMD reduction moves over dp (which
    reduces the norm scales and the embedding over dp x fsdp at their whole size), where the
    per-micro-batch mode moves 4 times that."""
    plan, auto, micro, one, one_cfg = modes
    cfg = tiny_config(*plan, *ACC4)
    got = _rows(auto.text, cfg)
    per_micro = _rows(micro.text, tiny_config(*plan, *ACC4, "plan.grad_sync=microbatch"))
    single = _rows(one, one_cfg)
    params = auto.setup.abstract_state().params
    shard = sum(4 * math.prod(p.sharding.shard_shape(p.shape)) for p in jax.tree.leaves(params))
    assert _over_dp(got) == shard + 8
    assert _over_dp(got) <= _over_dp(single) * 1.02
    assert _over_dp(per_micro) == pytest.approx(4 * _over_dp(single), rel=0.02)
    # and inspect's theory is the census row by row in both modes
    for rows in (got, per_micro):
        for k, r in rows.items():
            assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=1e-3), (k, r)


def test_the_once_per_step_accumulator_shows_in_compiled_temp_as_the_planner_predicts():
    """fsdp8, bf16, 4 micro-batches: grad_sync=step holds the fp32 accumulator and the parameters
    whole over fsdp for the step; the compiled temp grows by what the planner's terms add (3.14
    MB against 3.18; 4.01 with the accumulator counted twice, the loop's carry in and out, and
    the gathered parameters at 2 bytes where XLA:CPU's all-gather returns f32)."""
    plan = ("mesh.dp=1", "mesh.fsdp=8", "mesh.tp=1", *ACC4, *PRECISION)
    temp, predicted = {}, {}
    for mode in ("auto", "step"):
        cfg = tiny_config(*plan, f"plan.grad_sync={mode}")
        compiled = build(cfg).lower_train_step().compile()
        temp[mode] = compiled.memory_analysis().temp_size_in_bytes
        predicted[mode] = planner_memory.estimate(plan_lib.Spec.from_config(cfg, 8)).total
    grew, said = temp["step"] - temp["auto"], predicted["step"] - predicted["auto"]
    assert said > 0 and grew == pytest.approx(said, rel=0.05), (grew, said)


@pytest.fixture(scope="module")
def one_device_acc4():
    """One device over the same 4 micro-batches: the reference of every method below."""
    return numerics.one_device(*ACC4)


@pytest.mark.parametrize("method", ["int8", "powersgd", "sparse embedding"])
def test_a_strategys_own_mean_once_per_micro_batch(method, one_device_acc4):
    """`plan.grad_sync=microbatch` with compression or the sparse embedding exchange on HSDP:
    the data region loops over the 4 micro-batches, each one's gradients through the strategy's
    mean over dp (its state threaded through), the means weighted by their tokens: 3 updates
    track one device within the method's tolerance (the sparse exchange is exact), and the
    census is the formula row by row; compression's bytes over dp are 4 times the once-per-step
    mode's."""
    own = {"int8": ("plan.compression=int8",),
           "powersgd": ("plan.compression=powersgd", "plan.compression_rank=2"),
           "sparse embedding": ("plan.sparse_embedding=true",)}[method]
    plan = (*HSDP, *ACC4, *own)
    got = numerics.run((*plan, "plan.grad_sync=microbatch"))
    numerics.assert_matches(got, one_device_acc4, numerics.COMPRESSION.get(
        method.split()[0], numerics.FP32))
    cfg = tiny_config(*plan, "plan.grad_sync=microbatch")
    rows = _rows(got.text, cfg)
    for r in rows.values():
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=1e-3), r
    if method != "sparse embedding":
        once = plan_lib.Spec.from_config(tiny_config(*plan), 8)
        per_step = sum(c.bytes for c in plan_lib.collectives(once) if c.axes == ("dp",))
        over_dp = sum(r["census_bytes"] for (_, axes), r in rows.items() if axes == ("dp",))
        assert over_dp == pytest.approx(4 * per_step, rel=1e-3)
