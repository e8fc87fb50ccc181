"""Mixture of experts and expert parallelism: ep = 1, 2, 4, 8 (with dp, fsdp, tp) give one
device's loss and gradients, dropless and with capacity (the same tokens drop at every degree);
dropping counted exactly; the router losses reach the router; the all-to-all census equals the
planner's formula; checkpoints move across ep degrees; bad plans are named.
(models/moe.py, jaxscale/strategies/ep.py)"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale import plan, planner
from jaxscale.analysis import inspect, validation
from jaxscale.axes import use_rules
from jaxscale.data import Batches, load_corpus
from jaxscale.models import Llama, moe
from jaxscale.strategies.tables import params as params_lib
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train.setup import build
from tests.helpers import MESH_1, tiny_config

#: dim 32, 4 heads, 8 experts of ffn 64, top-2, 2 layers, seq 16, batch 8
TINY = ("model.dim=32", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_dim=64",
        "model.moe_experts=8", "model.moe_top_k=2", "data.seq_len=16")
DROPLESS = ("model.moe_dropless=true", "plan.moe_buffer=8")   # f = ep: nothing overflows
CAPACITY = ("model.capacity_factor=1.0",)          # 4 slots per expert and sequence: drops
MESHES = {1: ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "mesh.ep=1"),
          2: ("mesh.dp=1", "mesh.fsdp=2", "mesh.tp=2", "mesh.ep=2"),
          4: ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4"),
          8: ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=8")}
_SETUPS: dict = {}


def setup_of(*overrides, devices=None):
    """One Setup per config for the whole module (each compiles its programs once)."""
    key = (overrides, devices is not None)
    if key not in _SETUPS:
        cfg = tiny_config(*TINY, *overrides)
        _SETUPS[key] = build(cfg, devices)
    return _SETUPS[key]


def batch_for(setup, step=0):
    cfg = setup.cfg
    b = Batches(load_corpus(cfg.data).train, cfg.data.batch_size, cfg.data.seq_len, seed=0)
    return b.device_batch(step, setup.batch_shardings())


def loss_and_grads(setup, state=None):
    state = state or setup.init_state()
    if not hasattr(setup, "_grads"):
        setup._grads = setup.jit_grads()                # compiled once per setup
    grads, loss, _ = setup._grads(state.params, batch_for(setup))
    return float(loss), jax.device_get(grads)


def forward_stats(setup, params):
    """The model's MoE statistics for the first batch, under the plan's rules."""
    def f(p, tokens):
        with use_rules(setup.placement.mesh, setup.placement.rules):
            return setup.model.module(p)(tokens, return_aux=True)[1]
    with jax.set_mesh(setup.placement.mesh):
        return jax.device_get(jax.jit(f)(params, batch_for(setup)["inputs"]))


def assert_close(got, ref):
    loss, grads = got
    np.testing.assert_allclose(loss, ref[0], rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref[1])):
        err = np.abs(a - b).max() / (np.abs(b).max() + 1e-12)
        assert err < 1e-4, (jax.tree_util.keystr(path), err)


@pytest.fixture(scope="module")
def one_device():
    """Single-device references: dropless, and with capacity (tokens dropped)."""
    dev = jax.devices()[:1]
    return {mode: loss_and_grads(setup_of(*MESH_1, *ov, devices=dev))
            for mode, ov in (("dropless", DROPLESS), ("capacity", CAPACITY))}


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("mode,ep", [("dropless", 1), ("dropless", 2), ("dropless", 8),
                                     ("capacity", 4)])
def test_expert_parallel_matches_one_device(mode, ep, one_device):
    ov = DROPLESS if mode == "dropless" else CAPACITY
    assert_close(loss_and_grads(setup_of(*MESHES[ep], *ov)), one_device[mode])


#: tokens split along the sequence where the experts read them: context parallelism (ring with
#: its zig-zag layout, Ulysses) and Megatron SP (each tp rank dispatches its own tokens)
SPLIT = {"ep2 x sp2 x tp2 ring": ("mesh.dp=1", "mesh.fsdp=1", "mesh.ep=2", "mesh.sp=2",
                                  "mesh.tp=2"),
         "dp2 x ep2 x tp2 megatron-sp": ("mesh.dp=2", "mesh.fsdp=1", "mesh.ep=2", "mesh.tp=2",
                                         "plan.sequence_parallel=true"),
         "fsdp2 x sp2 x tp2 ulysses megatron-sp": (
             "mesh.dp=1", "mesh.fsdp=2", "mesh.sp=2", "mesh.tp=2", "plan.context=ulysses",
             "plan.sequence_parallel=true")}


@pytest.mark.parametrize("mode,layout", [("dropless", "ep2 x sp2 x tp2 ring"),
                                         ("capacity", "ep2 x sp2 x tp2 ring"),
                                         ("capacity", "dp2 x ep2 x tp2 megatron-sp"),
                                         ("dropless", "fsdp2 x sp2 x tp2 ulysses megatron-sp")])
def test_split_sequences_match_one_device(mode, layout, one_device):
    """The grouped experts on a sequence split over devices: capacity counted over the whole
    sequence in token order (the same tokens drop as on one device, zig-zag or not), and with
    Megatron SP every tp rank dispatching only its own tokens."""
    ov = DROPLESS if mode == "dropless" else CAPACITY
    assert_close(loss_and_grads(setup_of(*SPLIT[layout], *ov)), one_device[mode])


def test_bounded_exchange_counts_its_overflow(monkeypatch):
    """At ep = 8 with plan.moe_buffer=1 each device sends each peer (one expert) at most
    S = ceil(1 x 16 tokens x 2 / 8) = 4 rows; the rest overflow. The reported dropped share
    equals the overflow counted by hand from the router's choices, sequence by sequence (one
    sequence per device)."""
    setup = setup_of(*MESHES[8], "model.moe_dropless=true", "plan.moe_buffer=1")
    params = setup.init_state().params
    logits = router_logits(setup, params, monkeypatch)
    over = 0
    for layer in logits:
        idx = np.argsort(-layer, axis=-1, kind="stable")[..., :2]          # [B, T, k]
        for seq in idx:
            over += np.maximum(np.bincount(seq.ravel(), minlength=8) - 4, 0).sum()
    stats = forward_stats(setup, params)
    assert over > 0 and float(stats["dropped"]) == over


def test_expert_parallel_with_zero3_and_remat_matches_one_device(one_device):
    assert_close(loss_and_grads(setup_of(*MESHES[4], *CAPACITY, "plan.zero=3",
                                         "plan.remat=full")), one_device["capacity"])


def test_capacity_drops_the_same_tokens_at_every_degree():
    """Capacity is counted per sequence, so the dropped count is the same on one device and at
    ep = 4 (where the drops also happen: the numerics above then cover dropping)."""
    ref = setup_of(*MESH_1, *CAPACITY, devices=jax.devices()[:1])
    params = ref.init_state().params
    one = forward_stats(ref, params)
    sharded = setup_of(*MESHES[4], *CAPACITY)
    ep4 = forward_stats(sharded, jax.device_put(params, sharded.device_shardings.params))
    assert one["dropped"] > 0 and one["dropped"] == ep4["dropped"]
    np.testing.assert_allclose(one["expert_share"], ep4["expert_share"], atol=1e-7)


# ----------------------------------------------------------------------------- routing
def _moe_layer(**kw):
    cfg = dataclasses.replace(tiny_config(*TINY).model, **kw)
    return cfg, moe.MoE(cfg, rngs=nnx.Rngs(0))


def test_capacity_without_drops_equals_dropless():
    """capacity_factor = E / k gives every expert T slots: nothing drops, and the slot buffer
    computes what the sorted grouped matmuls (`ragged_dot`) compute."""
    x = jax.random.normal(jax.random.key(3), (2, 16, 32))
    _, full = _moe_layer(capacity_factor=4.0)
    _, dropless = _moe_layer(moe_dropless=True)
    (y, stats), (ref, _) = full(x), dropless(x)
    assert float(stats["dropped"]) == 0
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_top_k_weights_sum_to_one_and_pick_the_largest():
    x = jax.random.normal(jax.random.key(1), (3, 16, 32))
    router = jax.random.normal(jax.random.key(2), (32, 8))
    logits, probs, w, idx = moe.route(x, router, 3)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    top_p, top_i = jax.lax.top_k(probs, 3)
    np.testing.assert_array_equal(idx, top_i)
    np.testing.assert_allclose(w, top_p / top_p.sum(-1, keepdims=True), rtol=1e-6)
    tie = moe.route(x, jnp.zeros((32, 8)), 2)[3]          # all equal: the lower indices win
    np.testing.assert_array_equal(tie, np.broadcast_to([0, 1], tie.shape))


def test_dropped_assignments_are_counted_exactly():
    """A zero router ties every expert: each of the T tokens of each sequence picks experts 0
    and 1, which hold C = ceil(1.0 x T x 2 / 8) slots each; the rest, 2 (T - C) per sequence,
    are dropped, the later tokens' (the output of a dropped token's expert is zero)."""
    cfg, layer = _moe_layer(capacity_factor=1.0)
    layer.router[...] = jnp.zeros_like(layer.router[...])
    B, T = 3, 16
    C = cfg.moe_capacity(T)
    assert C == 4
    x = jax.random.normal(jax.random.key(0), (B, T, 32))
    y, stats = layer(x)
    assert float(stats["dropped"]) == B * 2 * (T - C) and float(stats["routed"]) == B * T * 2
    np.testing.assert_array_equal(np.asarray(y[:, C:]), 0.0)      # both choices dropped
    assert np.abs(np.asarray(y[:, :C])).min() > 0
    np.testing.assert_allclose(stats["expert_share"], [0.5, 0.5] + [0.0] * 6)
    # the slot positions themselves, on a constructed routing
    idx = jnp.array([[[0, 1], [0, 2], [1, 0], [3, 0]]])
    np.testing.assert_array_equal(moe.slot_positions(idx, 4), [[[0, 0], [1, 0], [1, 2], [0, 3]]])


def test_router_losses_reach_the_router_gradient(one_device):
    """The step optimises loss + w_aux x aux + w_z x z: the router's gradient differs from the
    unweighted one by exactly w_aux grad(aux) + w_z grad(z); the last layer's experts' does not
    change (earlier weights do: they shape later routers' inputs)."""
    plain = setup_of(*MESH_1, *DROPLESS, "model.moe_aux_weight=0", "model.moe_z_weight=0",
                     devices=jax.devices()[:1])
    m = tiny_config(*TINY).model
    params = plain.init_state().params
    g_w, g_0 = one_device["dropless"][1], loss_and_grads(plain)[1]
    tokens = batch_for(plain)["inputs"]

    def losses(p):
        aux = plain.model.module(p)(tokens, return_aux=True)[1]
        return m.moe_aux_weight * aux["aux_loss"] + m.moe_z_weight * aux["z_loss"]
    g_reg = jax.jit(jax.grad(losses))(params)
    r = lambda g: np.asarray(g["layers"]["mlp"]["router"])  # noqa: E731
    assert np.abs(r(g_reg)).max() > 1e-6
    assert np.abs(r(g_w) - r(g_0) - r(g_reg)).max() < 1e-3 * np.abs(r(g_reg)).max()
    for name in ("w_gate", "w_up", "w_down"):        # the last layer's experts: after every
        np.testing.assert_allclose(g_w["layers"]["mlp"][name][-1],  # router loss
                                   g_0["layers"]["mlp"][name][-1], atol=1e-9)


def test_every_second_layer_unscanned():
    cfg = dataclasses.replace(tiny_config(*TINY).model, n_layers=4, moe_every=2,
                              scan_layers=False)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    kinds = [type(b.mlp).__name__ for b in model.layers]
    assert kinds == ["MLP", "MoE", "MLP", "MoE"]
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == cfg.param_count() == params_lib.count(cfg)


# ----------------------------------------------------------------------------- census
@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_census_matches_the_formula(ep):
    """4 all-to-alls per MoE layer (dispatch and combine, forward and backward), each of the
    device's slot buffer: tokens x E C / T x dim x 4 bytes; every census row within 2%."""
    cfg = tiny_config(*TINY, *MESHES[ep], *CAPACITY)
    rep = inspect.report(cfg)
    rows = [c for c in rep["collectives"] if c["kind"] == "all-to-all"]
    L, T, B = cfg.model.n_layers, cfg.data.seq_len, cfg.data.batch_size
    tokens = B * T / (8 // cfg.mesh.tp)                 # per device: dp x fsdp x ep = 8 / tp
    buf = tokens * 8 * cfg.model.moe_capacity(T) / T * cfg.model.dim * 4
    assert [r["axes"] for r in rows] == [["ep"]] and rows[0]["count"] == 4 * L
    assert rows[0]["bytes"] == 4 * L * buf
    cmp = validation.compare(planner.predict(cfg), rep, backend="cpu")
    for r in cmp["collectives"]:
        assert r["ratio"] is not None and abs(r["ratio"] - 1) <= 0.02, r


# ----------------------------------------------------------------------------- checkpoints
def router_logits(setup, params, monkeypatch) -> list[np.ndarray]:
    """Each MoE layer's router logits [B, T, E] on the first batch, read out of the plan's
    forward pass (a host callback on what `moe.route` returns)."""
    seen, route = [], moe.route

    def recording_route(x, router, k, bias=None):
        out = route(x, router, k, bias)
        jax.debug.callback(lambda logits: seen.append(np.asarray(logits)), out[0])
        return out
    monkeypatch.setattr(moe, "route", recording_route)
    forward_stats(setup, params)
    monkeypatch.undo()
    return seen


def reference_router_metrics(logits_per_layer, k: int, capacity: int) -> dict:
    """The router losses and the dropped fraction by hand (numpy, float64) from the logits:
    softmax; top-k by probability, ties to the lower index; Switch balance E sum_e f_e P_e (f_e
    the share of the k N assignments, P_e the mean probability); z = mean logsumexp^2; each
    expert's `capacity` slots per sequence claimed in token order, a token's choices in rank
    order, the rest dropped. The losses averaged over layers, the drops over all assignments."""
    aux, z, dropped, routed = [], [], 0, 0
    for logits in logits_per_layer:
        x = logits.astype(np.float64)
        B, T, E = x.shape
        top = x.max(-1, keepdims=True)
        lse = top[..., 0] + np.log(np.exp(x - top).sum(-1))
        p = np.exp(x - lse[..., None])
        idx = np.argsort(-p, axis=-1, kind="stable")[..., :k]
        share = np.bincount(idx.ravel(), minlength=E) / idx.size
        aux.append(E * np.sum(share * p.mean(axis=(0, 1))))
        z.append(np.mean(lse ** 2))
        for row in idx:                                   # one sequence
            claims = np.zeros(E, int)
            for e in row.ravel():                         # token order, then rank order
                dropped += claims[e] >= capacity
                claims[e] += 1
        routed += idx.size
    return {"moe_aux_loss": np.mean(aux), "moe_z_loss": np.mean(z),
            "moe_dropped": dropped / routed}


def test_train_step_metrics_and_checkpoint_across_ep_degrees(tmp_path, monkeypatch):
    """A train step at ep = 4 (dp2) reports the router losses and the dropped fraction, equal to
    a numpy computation from the router logits of the same batch; its state saved there restores
    at ep = 2 (fsdp2 x tp2): the same arrays and the same next loss."""
    src, dst = setup_of(*MESHES[4], *CAPACITY), setup_of(*MESHES[2], *CAPACITY)
    assert src.placement.spec.accumulate <= 1                 # one forward over the whole batch
    logits = router_logits(src, src.init_state().params, monkeypatch)
    cfg = src.cfg.model
    assert len(logits) == cfg.n_layers and logits[0].shape == (8, 16, 8)
    want = reference_router_metrics(logits, cfg.moe_top_k, cfg.moe_capacity(16))
    state, m = src.train_step(src.init_state(), batch_for(src))
    assert 0.0 < want["moe_dropped"] < 1.0                   # capacity 4 of 16 tokens: drops
    for key in ("moe_aux_loss", "moe_z_loss", "moe_dropped"):
        np.testing.assert_allclose(float(m[key]), want[key], rtol=1e-5, err_msg=key)
    ck = ckpt_lib.Checkpointer(tmp_path / "ck", src.cfg.ckpt)
    ck.save(1, state, ckpt_meta.make_meta(src.cfg, state, 1))
    ck.wait()
    ck.close()
    ck = ckpt_lib.Checkpointer(tmp_path / "ck", dst.cfg.ckpt, read_only=True)
    restored = ck.restore(1, dst.abstract_state(), ck.read_meta(1)["checksums"])
    assert restored.params["layers"]["mlp"]["w_gate"].sharding.spec[1] == "ep"
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                                     restored, state))
    np.testing.assert_allclose(loss_and_grads(dst, restored)[0], loss_and_grads(src, state)[0],
                               rtol=1e-6)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("overrides, msg", [
    (("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4", "model.moe_experts=6"),
     "model.moe_experts=6 is not divisible by mesh.ep=4"),
    (("model.moe_experts=4", "model.moe_top_k=5"),
     "model.moe_experts=4, model.moe_top_k=5: give 0 experts"),
    (("model.moe_experts=4", "model.capacity_factor=0"),
     "model.capacity_factor=0.0: must be a number > 0"),
    (("model.moe_experts=4", "model.capacity_factor=-1.5"), "model.capacity_factor=-1.5"),
    (("model.moe_experts=4", "model.moe_every=2"),
     "model.moe_every=2 mixes dense and expert layers, but model.scan_layers=true"),
    (("model.moe_experts=4", "plan.moe_dispatch=ragged"),
     "plan.moe_dispatch=ragged runs jax.lax.ragged_all_to_all, which XLA:CPU cannot run"),
    (("model.moe_experts=4", "plan.moe_buffer=0"), "plan.moe_buffer=0.0: must be a number > 0"),
    (("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=2", "mesh.ep=2"),
     "mesh.ep=2 needs a mixture-of-experts"),
])
def test_bad_moe_plans_are_refused_by_name(overrides, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        plan.validate(tiny_config(*overrides), 8)
