"""Mixtures of experts at production shape: the grouped experts' bounded exchange over ep (its
census against the routed volume, no worst-case buffer, the ragged all-to-all lowered for CUDA),
fine-grained and shared experts with auxiliary-loss-free (bias) balancing against one device on
expert, tensor and sequence parallel layouts, the bias's update rule, bad input.
(models/moe.py, jaxscale/strategies/ep/)"""
import dataclasses
import math
import re

import jax
import numpy as np
import pytest

from jaxscale import models, plan, planner
from jaxscale.analysis import inspect, validation
from jaxscale.interop import hf_config
from jaxscale.strategies.tables import params as params_lib
from jaxscale.train.setup import build
from tests import test_moe as base
from tests.helpers import MESH_1, assert_temp_within_tolerance, tiny_config

#: DeepSeek-MoE's shape on the tiny model: 8 experts of half the width, one shared, the
#: routing bias balanced from the load (no balance loss)
DEEPSEEK = ("model.moe_ffn_dim=32", "model.moe_shared_experts=1", "model.moe_bias_rate=0.01",
            "model.moe_aux_weight=0", *base.DROPLESS)
EP4 = base.MESHES[4]


@pytest.fixture(scope="module")
def deepseek_one_device():
    return base.loss_and_grads(base.setup_of(*MESH_1, *DEEPSEEK, devices=jax.devices()[:1]))


@pytest.mark.parametrize("layout", ["dp2 x ep4", "dp2 x ep2 x tp2 megatron-sp",
                                    "ep2 x sp2 x tp2 ring"])
def test_fine_grained_shared_biased_experts_match_one_device(layout, deepseek_one_device):
    mesh = EP4 if layout == "dp2 x ep4" else base.SPLIT[layout]
    base.assert_close(base.loss_and_grads(base.setup_of(*mesh, *DEEPSEEK)), deepseek_one_device)


def _with_bias(state, bias):
    """`state` with every layer's routing bias set to `bias` [L, E]."""
    mlp = state.params["layers"]["mlp"]
    at = jax.numpy.asarray(bias, mlp["router_bias"].dtype)
    params = {**state.params, "layers": {**state.params["layers"], "mlp": {
        **mlp, "router_bias": jax.device_put(at, mlp["router_bias"].sharding)}}}
    return dataclasses.replace(state, params=params)


def test_routing_bias_steps_by_the_sign_of_the_load():
    """The bias chooses the experts, does not weight them, and steps by the load (DeepSeek-V3).
    From a bias of +1 on experts 0 and 1 (a probability is below 1, so they win every token's
    top-2): every layer's load is [1/2, 1/2, 0, ...], and one update moves the bias by rate x
    sign(mean load - load): -rate on those two, +rate on the others. The loss differs from the
    unbiased model's (the bias changed the routing; the tiny model's initial experts move it
    little: 1.2e-5 of it), while a bias equal on every expert (the same choices) leaves the loss
    and the router's gradient unchanged: the chosen experts are weighted by their probabilities
    alone (weights from probability + bias would change the router's gradient several-fold)."""
    setup = base.setup_of(*MESH_1, *DEEPSEEK, devices=jax.devices()[:1])
    L, E = setup.init_state().params["layers"]["mlp"]["router_bias"].shape
    forced = np.zeros((L, E), np.float32)
    forced[:, :2] = 1.0
    share = base.forward_stats(setup, _with_bias(setup.init_state(), forced).params)
    np.testing.assert_array_equal(share["expert_share"], [[0.5, 0.5] + [0.0] * (E - 2)] * L)
    state, metrics = setup.train_step(_with_bias(setup.init_state(), forced),
                                      base.batch_for(setup))
    got = np.asarray(state.params["layers"]["mlp"]["router_bias"])
    np.testing.assert_allclose(got, forced + 0.01 * np.array([-1, -1] + [1] * (E - 2)),
                               rtol=1e-6)
    unbiased = base.setup_of(*MESH_1, *DEEPSEEK[:2], "model.moe_aux_weight=0", *base.DROPLESS,
                             devices=jax.devices()[:1])
    loss, grads = base.loss_and_grads(unbiased)
    assert abs(float(metrics["loss"]) - loss) > 5e-6 * loss       # measured 1.2e-5
    even = np.full((L, E), 0.5, np.float32)
    even_loss, even_grads = base.loss_and_grads(setup, _with_bias(setup.init_state(), even))
    np.testing.assert_allclose(even_loss, loss, rtol=1e-6)          # measured 0
    router = [np.asarray(g["layers"]["mlp"]["router"]) for g in (even_grads, grads)]
    assert np.abs(router[0] - router[1]).max() <= 1e-5 * np.abs(router[1]).max()


def test_preset_counts_its_parameters():
    m = models.get("tiny-deepseek-moe")
    assert (m.moe_experts, m.moe_top_k, m.expert_ffn, m.moe_shared_experts) == (16, 4, 96, 1)
    d, L, V, E = m.dim, m.n_layers, m.vocab_size, m.moe_experts
    attn = d * m.hd * (2 * m.n_heads + 2 * m.n_kv_heads)
    layer = attn + 2 * d + d * E + E + (E + 1) * 3 * d * 96     # router, bias, experts, shared
    assert m.param_count() == params_lib.count(m) == 2 * V * d + L * layer + d
    assert m.param_count(active=True) == params_lib.active_count(m) == \
        m.param_count() - L * (E + (E - 4) * 3 * d * 96)


def test_collective_matmul_with_experts_matches_one_device_and_its_census(
        deepseek_one_device):
    """Collective matmul over a mixture (Megatron SP, dp2 x ep2 x tp2): the attention's and the
    shared experts' matmuls run as rings of permutes, the routed experts in their own region;
    one device's loss and gradients, and every census row the planner's."""
    ov = (*base.SPLIT["dp2 x ep2 x tp2 megatron-sp"], *DEEPSEEK,
          "plan.tp_overlap=collective_matmul")
    base.assert_close(base.loss_and_grads(base.setup_of(*ov)), deepseek_one_device)
    cfg = tiny_config(*base.TINY, *ov)
    cmp = validation.compare(planner.predict(cfg), inspect.report(cfg), backend="cpu")
    assert any(r["kind"] == "collective-permute" for r in cmp["collectives"])
    assert_temp_within_tolerance(cmp)
    for r in cmp["collectives"]:
        assert r["ratio"] is not None and abs(r["ratio"] - 1) <= 0.02, r


# ----------------------------------------------------------------------------- the exchange
@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_bounded_exchange_moves_the_routed_volume_times_its_factor(factor):
    """Dropless dp2 x ep4: per MoE layer 4 all-to-alls of ep x S rows, S = ceil(f N k / ep)
    per peer (16 local tokens, top-2), and one of the [ep, E / ep] int32 counts; the rows'
    bytes are f x the routed volume (exact here) and every census row equals the planner's.
    The compiled step holds no worst-case [E, b, T, dim] buffer."""
    cfg = tiny_config(*base.TINY, *EP4, *base.DROPLESS, f"plan.moe_buffer={factor}")
    rep = inspect.report(cfg)
    L, D, k, n = cfg.model.n_layers, cfg.model.dim, 2, 16
    S = math.ceil(factor * n * k / 4)
    routed = n * k * D * 4
    a2a = [c for c in rep["collectives"] if c["kind"] == "all-to-all"]
    assert [c["axes"] for c in a2a] == [["ep"]] and a2a[0]["count"] == 5 * L
    rows = a2a[0]["bytes"] - L * 4 * 2 * 4                 # less the counts
    assert rows == 4 * L * 4 * S * D * 4
    assert abs(rows / (4 * L * routed) / factor - 1) <= 0.10
    cmp = validation.compare(planner.predict(cfg), rep, backend="cpu")
    for r in cmp["collectives"]:
        assert r["ratio"] is not None and abs(r["ratio"] - 1) <= 0.02, r
    assert_temp_within_tolerance(cmp)
    if factor == 1.0:          # S = 8 rows per peer: no array is [E, b, T, D] or [E/ep, ep b,
        text = build(cfg).lower_train_step().compile().as_text()      # T, D] (T = 16)
        assert not re.search(r"\[(8,1|2,4),16,32\]", text)


@pytest.mark.parametrize("overrides", [("plan.zero=2",), ("plan.zero=3", *base.DROPLESS)])
def test_zero_with_expert_parallelism_census_equals_the_planner(overrides):
    """ZeRO-2/3 with ep (dp2 x ep4): a layer's non-expert matmul gradients are reduced over
    (dp, ep) as one group, the head's over dp then ep, the experts' over dp alone: every census
    row within 2% of the planner's."""
    cfg = tiny_config(*base.TINY, *EP4, *overrides)
    cmp = validation.compare(planner.predict(cfg), inspect.report(cfg), backend="cpu")
    rows = {(r["kind"], tuple(r["axes"])): r["ratio"] for r in cmp["collectives"]}
    assert ("all-reduce", ("dp", "ep")) in rows and ("all-reduce", ("ep",)) in rows
    assert_temp_within_tolerance(cmp)
    for key, ratio in rows.items():
        assert ratio is not None and abs(ratio - 1) <= 0.02, (key, ratio)


@pytest.mark.parametrize("mesh", [EP4, base.SPLIT["dp2 x ep2 x tp2 megatron-sp"]])
def test_ragged_dispatch_lowers_for_cuda(mesh):
    """plan.moe_dispatch=ragged: the rows travel through `ragged_all_to_all` (XLA:CPU cannot
    run it, so the step is lowered for CUDA here): 2 forward and 2 backward per layer, in the
    scanned layer's body; the counts still through one all-to-all. Under Megatron SP the
    received rows are gathered over tp between the two exchanges."""
    cfg = tiny_config(*base.TINY, *mesh, *base.DROPLESS, "plan.moe_dispatch=ragged",
                      "mesh.device_kind=h100", "plan.check_memory=false")
    setup = build(cfg)
    with jax.set_mesh(setup.placement.mesh):
        lowered = setup.train_step.trace(setup.abstract_state(), setup.abstract_batch()).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("ragged_all_to_all") == 4
    ep = setup.placement.mesh.shape["ep"]        # offsets and sizes: one per peer, both ways
    sizes = [re.findall(r"tensor<(\d+)xi32>", line.split(" : (")[-1])
             for line in text.splitlines() if "ragged_all_to_all" in line]
    assert all(s == [str(ep)] * 4 for s in sizes), sizes
    with pytest.raises(ValueError, match="use plan.moe_dispatch=padded"):
        plan.validate(tiny_config(*base.TINY, *mesh, "plan.moe_dispatch=ragged"), 8)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("overrides, msg", [
    (("model.moe_experts=4", "model.moe_shared_experts=5"),
     "model.moe_shared_experts=5 exceeds model.moe_experts=4"),
    (("model.moe_experts=4", "model.moe_bias_rate=1.5"), "model.moe_bias_rate=1.5"),
    (("model.moe_experts=4", "model.moe_bias_rate=-0.1"), "model.moe_bias_rate=-0.1"),
    (("model.moe_shared_experts=1",),
     "model.moe_shared_experts=1 configures a mixture of experts, but model.moe_experts=0"),
])
def test_bad_expert_shapes_are_refused_by_name(overrides, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        plan.validate(tiny_config(*overrides), 8)


def test_mixtral_export_refuses_what_mixtral_lacks():
    with pytest.raises(ValueError, match="Mixtral has no shared experts"):
        hf_config.config_to_hf(models.get("tiny-deepseek-moe"))
