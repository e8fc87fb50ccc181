"""Pipeline stages as layouts (`jaxscale.strategies.pp.stages`) and the pipeline with the
strategies that change what a stage computes: uneven stages (3+1 and 2+3 layers) and mixtures
of experts over ep (dropping and dropless) against one device, local SGD's replicas made of
pipelines against the same replicas without one, checkpoints restored under another stage
layout, schedule and pp, and the default layout `auto` on published shapes."""
import jax
import numpy as np
import pytest

from jaxscale import plan
from jaxscale.data import Batches, load_corpus
from jaxscale.strategies.pp import stages
from jaxscale.strategies.pp.schedules import loop_placement, v_placement
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train import disk
from jaxscale.train.setup import build
from tests import numerics
from tests.helpers import tiny_config

MOE = ("model.n_layers=4", "plan.accumulate=2", "data.batch_size=16", "model.moe_experts=4",
       "mesh.fsdp=1")
CASES = {   # name -> (shared overrides, the pipeline's mesh and layout)
    "MoE pp2 x ep2 x tp2": (MOE, ("mesh.dp=1", "mesh.pp=2", "mesh.ep=2", "mesh.tp=2")),
    "MoE pp2 x dp2 x ep2": (MOE, ("mesh.dp=2", "mesh.pp=2", "mesh.ep=2", "mesh.tp=1")),
    "MoE pp2 x dp2 x ep2 dropless": ((*MOE, "model.moe_dropless=true"),
                                     ("mesh.dp=2", "mesh.pp=2", "mesh.ep=2", "mesh.tp=1")),
    "uneven 3+1": (("model.n_layers=4", "plan.accumulate=2", "data.batch_size=8"),
                   ("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1",
                    "plan.stage_layers=3,1")),
    "uneven 2+3 ZB-H1": (("model.n_layers=5", "plan.accumulate=2", "data.batch_size=8"),
                         ("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1",
                          "plan.stage_layers=2,3", "plan.schedule=zb-h1")),
}


@pytest.mark.parametrize("case", CASES)
def test_stage_family_matches_one_device(case):
    shared, mesh = CASES[case]
    got = numerics.run((*shared, *mesh))
    ref = numerics.one_device(*shared)
    tol = numerics.MOE if case.startswith("MoE") else numerics.FP32
    print(case, numerics.assert_matches(got, ref, tol))
    for key in ref.metrics[0]:        # the router losses and the dropped share, summed over the
        if key.startswith("moe_"):    # stages and micro-batches as one device sums its layers
            assert got.metrics[0][key] == pytest.approx(ref.metrics[0][key], rel=1e-5), key
    order = got.setup.layout.layer_order
    if case.startswith("uneven"):     # the shorter stage's block ends in padding rows
        counts = stages.counts(got.setup.placement.spec)
        assert counts == tuple(int(c) for c in mesh[-2 if "ZB" in case else -1]
                               .split("=")[1].split(","))
        rows = max(counts)
        assert len(order) == 2 * rows and order.count(-1) == 2 * rows - sum(counts)
        assert sorted(r for r in order if r >= 0) == list(range(sum(counts)))
        padding = [i for i, r in enumerate(order) if r < 0]
        params = jax.device_get(got.setup.init_state().params)["layers"]["attn"]["wq"]
        assert not np.any(params[padding]) and np.all(np.any(params[[i for i in range(
            len(order)) if i not in padding]], axis=(1, 2, 3)))


def test_local_sgd_replicas_can_be_pipelines():
    """DiLoCo over dp2 whose replicas are pp2 x tp2 pipelines, 4 updates (2 averages), against
    the same replicas as fsdp2 x tp2 groups (one device has no replicas to average)."""
    d = ("plan.local_sgd=diloco", "plan.local_steps=2", "model.n_layers=4",
         "plan.accumulate=2", "data.batch_size=8", "mesh.dp=2", "mesh.tp=2")
    flat = numerics.run((*d, "mesh.fsdp=2"), steps=4)
    piped = numerics.run((*d, "mesh.pp=2", "mesh.fsdp=1"), steps=4)
    numerics.assert_matches(piped, flat, numerics.Tolerance(
        None, 1e-5, 2e-2, 1e-3, "fp32 in another order; local SGD's step shows no gradient"))


# ----------------------------------------------------------------------------- checkpoints
def _next_loss(setup, state, step: int) -> float:
    """The loss the next step would report (its forward, before the update): the eval step's,
    which compiles the plan's forward only."""
    cfg = setup.cfg
    b = Batches(load_corpus(cfg.data).train, cfg.data.batch_size, cfg.data.seq_len, seed=0)
    total, tokens = setup.eval_step(state.params, b.device_batch(step, setup.batch_shardings()))
    return float(total) / float(tokens)


def _saved(setup, tmp_path):
    """The state after one step under `setup`, saved as `train` saves it; and the next loss."""
    state = setup.init_state()
    b = Batches(load_corpus(setup.cfg.data).train, setup.cfg.data.batch_size,
                setup.cfg.data.seq_len, seed=0)
    state, _ = setup.train_step(state, b.device_batch(0, setup.batch_shardings()))
    keep = jax.tree.map(lambda a: a.copy(), state)
    kept = disk.to_disk(keep, setup.cfg.model.vocab_size, setup.layout.layer_order)
    ck = ckpt_lib.Checkpointer(tmp_path, setup.cfg.ckpt)
    ck.save(1, kept, ckpt_meta.make_meta(setup.cfg, kept, 1))
    ck.wait()
    ck.close()
    return _next_loss(setup, state, 1)


def _restored_loss(overrides, tmp_path):
    cfg = tiny_config(*overrides)
    setup = build(cfg, donate=False)
    _, state, meta, _ = ckpt_lib.restore_latest(tmp_path, cfg.ckpt, cfg, setup.abstract_state(),
                                                setup.layout.layer_order)
    assert meta["step"] == 1
    return _next_loss(setup, state, 1)


@pytest.mark.parametrize("source,targets", [
    (("mesh.pp=2", "mesh.sp=2", "mesh.tp=2", "mesh.fsdp=1"),
     [("mesh.pp=1", "mesh.sp=2", "mesh.tp=2", "mesh.fsdp=2"),
      ("mesh.pp=4", "mesh.sp=2", "mesh.tp=1", "mesh.fsdp=1", "plan.accumulate=4")]),
    (("mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1", "plan.stage_layers=3,1"),
     [("mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1"),
      ("mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2", "plan.schedule=zb-v", "plan.accumulate=4")]),
])
def test_a_checkpoint_restores_under_another_layout(source, targets, tmp_path):
    """Written under one layout (pp2 x sp2; uneven 3+1 stages) after a step, restored at pp1 and
    pp4 (an even layout and ZB-V's V): the next step's loss is the same (fp32 in another
    order)."""
    common = ("model.n_layers=4", "data.batch_size=8", "mesh.dp=1", "plan.accumulate=2")
    src = build(tiny_config(*common, *source), donate=False)
    want = _saved(src, tmp_path)
    for target in targets:
        assert _restored_loss((*common, *target), tmp_path) == pytest.approx(want, rel=1e-5), \
            target


# ----------------------------------------------------------------------------- layouts
def test_auto_balances_the_embedding_and_the_head():
    """Llama 3 405B's 126 layers on 16 stages: the head costs 0.64 of a layer, so the first and
    last stages take 7 and the others 8 (the published layout); it is a plan `train` accepts at
    TP8 x PP16 x DP8."""
    from jaxscale import models
    from jaxscale.config import Config, DataConfig, apply_overrides
    from jaxscale.mesh import MeshConfig
    cfg = Config(model=models.get("llama3-405b"), data=DataConfig(seq_len=8192, batch_size=128),
                 mesh=MeshConfig(dp=8, pp=16, fsdp=1, tp=8, device_kind="h100"))
    cfg = apply_overrides(cfg, ["plan.precision=bf16", "plan.accumulate=16"])
    spec = plan.validate(cfg, 1024)
    assert stages.counts(spec) == (7,) + (8,) * 14 + (7,)
    assert stages.device_layers(spec) == [7] + [8] * 14 + [7] and spec.stored_layers == 8
    assert plan.unavailable(spec) == []
    # equal costs split evenly, any remainder on the later stages; one device each at least
    assert stages.balanced(8, loop_placement(2), 0.0, 0.0) == (4, 4)
    assert stages.balanced(7, loop_placement(2), 0.0, 0.0) == (3, 4)
    assert stages.balanced(3, loop_placement(2), 0.0, 5.0) == (2, 1)
    # the V placement puts the first and the last stage on device 0: balanced per device
    assert stages.balanced(9, v_placement(2), 0.0, 1.0) == (2, 2, 3, 2)
    assert sum(stages.balanced(126, v_placement(8), 0.0, 0.64)) == 126


def test_stored_order_pads_each_block():
    spec = plan.Spec.from_config(tiny_config("model.n_layers=5", "mesh.dp=1", "mesh.pp=2",
                                             "mesh.fsdp=4", "mesh.tp=1",
                                             "plan.stage_layers=2,3"))
    assert stages.layer_order(spec) == [0, 1, -1, 2, 3, 4]
    tree = {"layers": {"w": np.arange(5.0)}}
    moved = stages.reorder(tree, None, stages.layer_order(spec))
    assert list(moved["layers"]["w"]) == [0, 1, 0, 2, 3, 4]
    back = stages.reorder(moved, stages.layer_order(spec), None)
    assert list(back["layers"]["w"]) == list(range(5))
    zbv = spec.with_(schedule="zb-v", stage_layers="1,1,1,2", accumulate=4)
    # device 0 holds stages 0 and 3, device 1 stages 1 and 2
    assert stages.layer_order(zbv) == [0, -1, 3, 4, 1, -1, 2, -1]
