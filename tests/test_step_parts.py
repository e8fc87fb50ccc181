"""The step's protocol: each strategy sets the parts of the train step it changes
(`StepParts`, composed by `plan.step_parts` in the written order), and takes over the model's
seams through `jaxscale.hooks`; two strategies for one part or one seam are an error naming
both, and an unknown part or implementation is named too."""
import inspect

import pytest

from jaxscale import hooks, plan
from jaxscale.axes import Rules, use_rules
from jaxscale.strategies.common import PARTS, StepParts
from tests.helpers import tiny_config

DP8 = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1")


def parts_of(*overrides):
    return plan.step_parts(plan.Spec.from_config(tiny_config(*overrides), 8))


@pytest.mark.parametrize("mod", [s for s in plan.STRATEGIES if hasattr(s, "shape_step")],
                         ids=lambda m: m.NAME)
def test_shape_step_has_the_protocol_signature(mod):
    assert list(inspect.signature(mod.shape_step).parameters) == ["spec", "parts"]


@pytest.mark.parametrize("overrides, owners", [
    ((), {"policy": "precision", "state_specs": "zero", "accumulate": "accumulate"}),
    ((*DP8, "plan.compression=topk"), {"reduce": "dp", "mean": "compression",
                                       "state.comm": "compression", "comm_specs": "compression"}),
    ((*DP8, "plan.compression=int8"), {"reduce": "dp", "mean": "compression"}),
    ((*DP8, "plan.sparse_embedding=true"), {"reduce": "dp", "mean": "sparse_embedding"}),
    ((*DP8, "plan.accumulate=2"), {"reduce": "dp", "accumulate": "accumulate"}),
    ((*DP8, "plan.accumulate=2", "plan.grad_sync=microbatch"), {"accumulate": "accumulate"}),
    ((*DP8, "plan.local_sgd=diloco", "plan.local_steps=4"),
     {"train_step": "local_sgd", "state.comm": "local_sgd", "state_optimizer": "local_sgd",
      "comm_specs": "local_sgd"}),
    (("plan.qat=fp8",), {"probe": "qat", "state.quant": "qat"}),
    (("plan.prune=2:4",), {"after_update": "prune"}),
    (("plan.offload=optimizer",), {"update": "offload", "memory_kinds": "offload"}),
    (("plan.remat=full",), {"block_wrapper": "remat"}),
    (("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1", "plan.accumulate=2",
      "model.n_layers=4", "plan.schedule=interleaved", "plan.virtual_stages=2"),
     {"grads": "pp", "layer_order": "pp"}),
    (("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=1", "mesh.sp=2"),
     {"batch_view": "sp", "batch_seq": "sp"}),
])
def test_each_strategy_sets_the_parts_it_changes(overrides, owners):
    parts = parts_of(*overrides)
    assert {k: parts.owner.get(k) for k in owners} == owners
    unset = set(PARTS) - set(parts.owner)       # what no strategy set keeps the plain step's
    assert all(getattr(parts, k) in (None, {}, "seq") for k in unset), unset


def test_the_parts_hold_what_the_plan_asks():
    parts = parts_of("plan.offload=optimizer+master", "plan.precision=bf16")
    assert parts.memory_kinds == {"optimizer": "pinned_host", "master": "pinned_host"}
    assert parts.policy.master and parts.policy.param_dtype == "bfloat16"
    pp = parts_of("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1", "plan.accumulate=2",
                  "model.n_layers=4", "plan.schedule=interleaved", "plan.virtual_stages=2")
    assert pp.layer_order == [0, 2, 1, 3]
    assert parts_of(*DP8, "plan.xla_preset=unbucketed").compiler_options == {
        "xla_gpu_all_reduce_combine_threshold_bytes": 0,
        "xla_gpu_all_gather_combine_threshold_bytes": 0,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 0}


def test_two_strategies_for_one_part_or_an_unknown_part_are_named():
    parts = StepParts().set("reduce", len, by="compression")
    with pytest.raises(ValueError, match="compression and sparse_embedding both set the train "
                                         "step's 'reduce'"):
        parts.set("reduce", len, by="sparse_embedding")
    with pytest.raises(ValueError, match="state.comm"):
        parts.set("state.comm", len, by="a").set("state.comm", len, by="b")
    with pytest.raises(ValueError, match="sets unknown step part 'reduction'; the parts are"):
        StepParts().set("reduction", len, by="x")


def test_seams_conflicts_and_unregistered_implementations_are_named():
    rules = Rules().set_seam("projection", "qat_int8", by="plan.qat=int8")
    with pytest.raises(ValueError, match="plan.tp_overlap=x and plan.qat=int8 both replace the "
                                         "model's weight matmuls"):
        rules.set_seam("projection", "collective_matmul", by="plan.tp_overlap=x")
    with pytest.raises(ValueError, match="unknown seam 'matmul'"):
        hooks.register("matmul", "mine")
    with use_rules(None, Rules().set_seam("experts", "nowhere", by="test")):
        with pytest.raises(ValueError, match="name 'nowhere' for the model's experts seam, but "
                                             "nothing is registered under it"):
            hooks.implementation("experts")
    with use_rules(None, Rules()):
        assert hooks.implementation("projection") is None      # no seam named: the default
    assert hooks.implementation("projection") is None           # outside a plan


def test_the_strategies_register_what_their_rules_name():
    for overrides, seam in (((*DP8, "plan.qat=int8"), "projection"),
                            (("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=1", "mesh.sp=2"), "context"),
                            (("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4",
                              "model.moe_experts=8"), "experts")):
        rules = plan.Spec.from_config(tiny_config(*overrides), 8).rules
        assert rules.seams[seam] in hooks.SEAMS[seam], (seam, rules.seams)
