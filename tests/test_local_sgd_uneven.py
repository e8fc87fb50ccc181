"""Streaming DiLoCo with fragments that do not divide the layers (`plan.outer_fragments`,
`strategies/local_sgd/fragments.py`): 5 layers in F = 2 strided fragments (layers 0, 2, 4 with
the embedding; 1, 3 with the final norm and the head), and pipelines whose stages hold layers
the stride does not reach alike (each stage's rows of a fragment's layers gathered into
slots: `fragments.selection`), averaged as without a pipeline. Each as the
divisible case is held: at H = 1 the fragments' averages are synchronous DP's step; blocking at
H = 2 each fragment is averaged at its own offset; each branch's census is its group's fp32
all-reduce, the formula's by hand from the shapes; the planner's terms per group."""
import dataclasses

import jax
import numpy as np
import pytest

from jaxscale import plan, planner
from jaxscale.analysis import inspect
from jaxscale.analysis.validation import tiny_config
from jaxscale.strategies import local_sgd
from jaxscale.strategies.local_sgd import fragments
from jaxscale.strategies.pp.stages import stored_order
from jaxscale.train.setup import build
from tests import numerics
from tests.test_local_sgd import DP8, SGD, batch, host

FIVE = ("model.n_layers=5",)
STREAM = ("plan.local_sgd=diloco", "plan.local_steps=2", "plan.outer_fragments=2")
SYNC = ("plan.local_sgd=diloco", "plan.outer_lr=1", "plan.outer_momentum=0",
        "plan.local_steps=1", "plan.outer_fragments=2")


def test_uneven_fragments_at_h1_equal_synchronous_dp():
    """F = 2 over 5 layers at H = 1 (outer lr 1, no momentum, the linear inner SGD): every
    fragment averaged every step, 3 updates equal DP's (the fp32 bound)."""
    dp = numerics.run((*DP8, *FIVE, *SGD))
    got = numerics.run((*DP8, *FIVE, *SGD, *SYNC))
    numerics.assert_matches(got, dp, dataclasses.replace(
        numerics.FP32, grads=None, why="the same fp32 steps; local SGD's step shows no mean "
        "gradient, the weights after each update are compared"))


def synced(h, layers, leaf) -> bool:
    """Whether every replica's rows `layers` of a stacked leaf and its `leaf` equal the anchor's."""
    a, r = h.params, h.comm["params"]
    w, wr = a["layers"]["mlp"]["w_up"], r["layers"]["mlp"]["w_up"]
    return (np.array_equal(r[leaf], np.broadcast_to(a[leaf], r[leaf].shape))
            and all(np.array_equal(wr[:, i], np.broadcast_to(w[i], wr[:, i].shape))
                    for i in layers))


@pytest.fixture(scope="module")
def blocking():
    s = build(tiny_config(*DP8, *FIVE, *STREAM, "optim.warmup_steps=0"))
    step = s.lower_train_step().compile()
    state, seen = s.init_state(), []
    with jax.set_mesh(s.placement.mesh):
        for i in range(2):
            state, _ = step(state, batch(i))
            seen.append(host(state))
    return s, step, seen


def test_uneven_fragments_are_averaged_at_their_offsets(blocking):
    """Step 0 (fragment 1's offset) averages layers 1, 3 and the head; step 1 layers 0, 2, 4
    and the embedding."""
    _, _, seen = blocking
    assert synced(seen[0], (1, 3), "head") and not synced(seen[0], (0,), "embed")
    assert not synced(seen[0], (0, 2, 4), "embed")
    assert synced(seen[1], (0, 2, 4), "embed") and not synced(seen[1], (1,), "head")


def test_each_branch_all_reduces_its_groups_bytes(blocking):
    """Each branch's census: the metrics (20 bytes) and its group's fp32 changes, by hand: the
    tiny model's layer (4 d^2 + 3 d f + 2 d weights; d = 128, f = 384, kv 4 heads of 16), the
    embedding on fragment 0, the final norm and the head on fragment 1."""
    s, step, _ = blocking
    spec, text, mesh = s.placement.spec, step.as_text(), s.placement.mesh
    d, f, V, kv = 128, 384, 320, 4 * 16
    layer = d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d
    want = [4 * (3 * layer + V * d), 4 * (2 * layer + d + d * V)]
    assert local_sgd.average_bytes(spec) == want
    for branch, bytes_ in enumerate([0] + want):
        one_hot = [float(b == branch) for b in range(3)]
        got = inspect.census(text, mesh, one_hot)
        assert [(c["kind"], c["axes"], c["bytes"]) for c in got] == [
            ("all-reduce", ["dp"], bytes_ + 20)], (branch, got)
    rows = inspect.theory_vs_census(plan.collectives(spec), inspect.census(
        text, mesh, plan.branch_share(spec)))
    assert [r["ratio"] for r in rows] == [pytest.approx(1.0)]
    # the planner: per step 1/H of each group, the peak the larger group's
    pred = planner.predict(tiny_config(*DP8, *FIVE, *STREAM))
    avg = [c for c in pred.collectives if "averaged once every" in c.what]
    assert sorted(c.bytes for c in avg) == sorted(b / 2 for b in want)


def test_uneven_cut_takes_and_puts_strided_rows_per_stage():
    """The runtime cut of a [6, ...] stack over 2 stages and F = 2 (per stage 3 rows: layers 0,
    2 | 4 to fragment 0 and 1 | 3, 5 to fragment 1, each stage's rows in 2 slots, a spare one
    empty), and of a [5, ...] stack whole (rows 0, 2, 4 and 1, 3): the parts are the model's
    layers p mod F, their shapes the formula's (`part_shape`), and `put` writes back what
    `take` read. (The stride inside a stage would put layer 3, row 0 of the second, in
    fragment 0.)"""
    rng = np.random.default_rng(0)
    for n, stages, frag0, frag1 in ((6, 2, [0, 2, 4, -1], [1, -1, 3, 5]),
                                    (5, 1, [0, 2, 4], [1, 3])):
        params = jax.tree.map(jax.numpy.asarray, {
            "embed": rng.normal(size=(4, 3)).astype("float32"),
            "layers": {"w": rng.normal(size=(n, 3)).astype("float32")}})
        cut = fragments.Cut.of(params, 2, stages)
        leaves = jax.tree.leaves(params)
        w = np.concatenate([np.asarray(params["layers"]["w"]), np.zeros((1, 3), "float32")])
        for p, rows_ in enumerate((frag0, frag1)):
            got = cut.take(leaves, (p,))[-1]
            np.testing.assert_array_equal(got, w[rows_])       # -1: the spare slot, zeros
            assert got.shape == fragments.part_shape((n, 3), fragments.STRIDED, 2, p, stages,
                                                     cut.sel)
        back = cut.put(leaves, (1,), [x * 0 for x in cut.take(leaves, (1,))])
        back = np.asarray(back[-1])
        ones = [r for r in frag1 if r >= 0]
        assert not back[ones].any() and np.array_equal(back[[r for r in frag0 if r >= 0]],
                                                       w[[r for r in frag0 if r >= 0]])


def test_uneven_fragments_in_pipeline_stages_match_dp_and_the_formula():
    """Each dp rank a pp2 x tp2 pipeline of 6 layers (3 per stage), F = 2 at H = 1: DP's step
    over 3 updates, and every census row the formula's (each group's all-reduce of its stages'
    slots: layers 0, 2 | 4 and 1 | 3, 5, two slots per stage each)."""
    mesh = ("mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "mesh.fsdp=1", "model.n_layers=6",
            "plan.accumulate=2", "data.batch_size=8")
    dp = numerics.run((*mesh, *SGD))
    got = numerics.run((*mesh, *SGD, *SYNC))
    numerics.assert_matches(got, dp, dataclasses.replace(
        numerics.FP32, grads=None, why="the same fp32 steps, weights compared"))
    spec = plan.Spec.from_config(tiny_config(*mesh, *SGD, *SYNC), 8).with_(device_kind="cpu")
    rows = inspect.theory_vs_census(plan.collectives(spec), inspect.census(
        got.text, got.setup.placement.mesh, plan.branch_share(spec)))
    assert {tuple(r["axes"]) for r in rows} >= {("dp",), ("pp",), ("tp",)}
    for r in rows:
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=1e-3), r


@pytest.mark.parametrize("layers, slots", [(5, (((0, 2), (1,)), ((1,), (0,)))),
                                           (2, (((0,), ()), ((), (0,))))])
def test_fragments_under_a_pipeline_average_the_models_layers(layers, slots):
    """5 layers on pp2 (stages of 3 and 2: the second's rows hold layers 3, 4, so the stride
    p::F inside a stage would average layer 3 with 0 and 2), and 2 (a layer a stage: the stride
    would put both in fragment 0 and average fragment 1's none), in F = 2 fragments at H = 2:
    the weights after 4 updates (2 averages) equal dp2 replicas without a pipeline, whose
    fragments are the layers p mod 2: 0, 2, 4 and 1, 3; 0 and 1 (fp32)."""
    data = (f"model.n_layers={layers}", "data.batch_size=8", "plan.accumulate=2",
            "optim.warmup_steps=0", *STREAM)
    piped = ("mesh.dp=2", "mesh.pp=2", "mesh.fsdp=2", "mesh.tp=1", *data)
    spec = plan.Spec.from_config(tiny_config(*piped), 8)
    assert fragments.selection(stored_order(spec), 2, 2) == slots
    got = numerics.run(piped, steps=4)
    ref = numerics.run(("mesh.dp=2", "mesh.pp=1", "mesh.fsdp=1", "mesh.tp=1", *data),
                       jax.devices()[:2], steps=4)
    numerics.assert_matches(got, ref, dataclasses.replace(
        numerics.FP32, grads=None, why="the same fp32 steps, weights compared"))
