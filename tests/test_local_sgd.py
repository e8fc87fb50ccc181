"""Local SGD over dp: H = 1 equals synchronous DP, replicas diverge and agree again, the outer
optimizers' formulas, the census (1/H of a parameter all-reduce, nothing else but the metrics),
exact resume mid-period, and refusals."""
import dataclasses
import math
import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxscale import plan, planner
from jaxscale.analysis import hlo, inspect
from jaxscale.analysis.validation import tiny_config
from jaxscale.config import CheckpointConfig
from jaxscale.strategies import local_sgd
from jaxscale.strategies.local_sgd import averaging as L
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train.setup import build
from tests import numerics

DP8 = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1")
#: SGD with momentum and weight decay, no clipping: linear in the gradients, so the replicas'
#: mean after one step is DP's step
SGD = ("optim.kind=sgd", "optim.momentum=0.9", "optim.clip_norm=0", "optim.lr=0.05",
       "optim.warmup_steps=0")


def batch(i):
    r = np.random.default_rng(i)
    out = {k: r.integers(0, 300, (8, 32)).astype(np.int32) for k in ("inputs", "targets")}
    return {**out, "mask": np.ones((8, 32), np.float32)}


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def run(s, steps, state=None, start=0, step=None):
    """(losses, final state on the host, final state) after `steps` steps from `state`, by
    `step` (a compiled train step) or the setup's jitted one."""
    state = s.init_state() if state is None else state
    step, losses = step or s.train_step, []
    with jax.set_mesh(s.placement.mesh):
        for i in range(start, start + steps):
            state, m = step(state, batch(i))
            losses.append(float(m["loss"]))
    return losses, host(state), state


@pytest.fixture(scope="module")
def dp_sgd():
    s = build(tiny_config(*DP8, *SGD))
    return s, run(s, 3)


@pytest.fixture(scope="module")
def diloco2():
    """DiLoCo (AdamW inside, outer Nesterov 0.7 / 0.9), H = 2: the setup and its train step,
    compiled once (the census reads the same program)."""
    s = build(tiny_config(*DP8, "plan.local_sgd=diloco", "plan.local_steps=2",
                          "optim.warmup_steps=0"))
    return s, s.lower_train_step().compile(), host(s.init_state())


def fresh(s, init):
    """The initial state, from its host copy (init_state compiles anew at every call)."""
    return jax.device_put(init, s.state_shardings)


@pytest.mark.parametrize("method", [("plan.local_sgd=local",),
                                    ("plan.local_sgd=diloco", "plan.outer_lr=1",
                                     "plan.outer_momentum=0")])
def test_h1_equals_synchronous_dp(method, dp_sgd):
    _, (ref_losses, ref, _) = dp_sgd
    s = build(tiny_config(*DP8, *SGD, *method, "plan.local_steps=1"))
    losses, got, _ = run(s, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert losses[-1] < losses[0] - 0.05                  # it trains
    err = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b)) / np.max(np.abs(b))),
                       got.params, ref.params)
    assert max(jax.tree.leaves(err)) < 2e-6, err
    # every replica equals the anchor after an average
    for a, r in zip(jax.tree.leaves(got.params), jax.tree.leaves(got.comm["params"])):
        assert r.shape == (8,) + a.shape and np.array_equal(r, np.broadcast_to(a, r.shape))


def test_h2_replicas_diverge_between_averages_and_agree_after(diloco2):
    s, step, init_host = diloco2
    state = fresh(s, init_host)
    init = init_host.params
    rep = state.comm["params"]
    leaf = jax.tree.leaves(rep)[0]
    assert leaf.sharding.spec[0] == "dp" and leaf.addressable_shards[0].data.shape[0] == 1
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(rep))
    terms = {t.what: t.bytes for t in local_sgd.memory(s.placement.spec)}
    assert per_device == terms["this device's replica of the parameters (fp32)"]
    assert terms["outer momentum (fp32)"] == per_device
    with jax.set_mesh(s.placement.mesh):
        state, _ = step(state, batch(0))                    # step 0: inner only
        one = host(state)
        state, _ = step(state, batch(1))                    # step 1: inner, then the average
        two = host(state)
    # between averages: the anchor stays, the 8 replicas moved apart from it and each other
    assert jax.tree.all(jax.tree.map(np.array_equal, one.params, init))
    for a, r in zip(jax.tree.leaves(one.params), jax.tree.leaves(one.comm["params"])):
        if a.ndim >= 2:
            spread = np.abs(r - r.mean(0)).max()
            assert spread > 1e-4 and not np.allclose(r[0], r[1])
    # after the average: the anchor moved and every replica restarted from it
    moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(two.params),
                                                jax.tree.leaves(init))]
    assert min(moved) > 0
    for a, r in zip(jax.tree.leaves(two.params), jax.tree.leaves(two.comm["params"])):
        assert np.array_equal(r, np.broadcast_to(a, r.shape))
    # the outer momentum is the first average's change: u = Delta, and the anchor moved by
    # lr (1 + beta) Delta (Nesterov)
    u = jax.tree.leaves(two.opt_state)
    for a, b, d in zip(jax.tree.leaves(two.params), jax.tree.leaves(init), u):
        np.testing.assert_allclose(a, b - 0.7 * 1.9 * d, rtol=1e-5, atol=1e-7)


def test_post_local_warmup_is_synchronous_then_replicas_part():
    """post_local with AdamW: in the warmup every replica takes DP's step (the token-mean
    gradient, one AdamW state), then they train apart; the census weighs each branch."""
    s = build(tiny_config(*DP8, "plan.local_sgd=post_local", "plan.local_warmup=2",
                          "plan.local_steps=4", "optim.warmup_steps=0"))
    step = s.lower_train_step().compile()
    _, two, state = run(s, 2, step=step)
    for leaf in jax.tree.leaves(two.comm):      # replicas and AdamW moments: 8 equal copies
        assert np.array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
    for a, r in zip(jax.tree.leaves(two.params), jax.tree.leaves(two.comm["params"])):
        assert np.array_equal(a, r[0])
    _, three, _ = run(s, 1, state, start=2, step=step)
    for leaf in jax.tree.leaves(three.comm):    # the first local step: they part
        if leaf.ndim >= 3:                      # (bitwise equal until now)
            assert (leaf[0] != leaf[1]).mean() > 0.1
    assert jax.tree.all(jax.tree.map(np.array_equal, three.params, two.params))
    size = sum(x.size for x in jax.tree.leaves(s.model.abstract_params))
    text, mesh = step.as_text(), s.placement.mesh
    ar = lambda share: sum(r["bytes"] for r in inspect.census(text, mesh, share))
    metrics = 4 * local_sgd.METRICS                      # 20 bytes
    assert ar([0.0, 0.0, 1.0]) == 4 * size + metrics     # warmup: DP's gradient all-reduce
    assert ar(local_sgd.branch_share(s.placement.spec)) == 4 * size / 4 + metrics


@pytest.mark.parametrize("method", ["slowmo", "diloco"])
def test_outer_step_formulas(method):
    """Two averages over 8 devices against the papers' formulas in NumPy."""
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    lr, beta, nesterov = local_sgd.DEFAULTS[method]
    outer = L.outer_optimizer(lr, beta, nesterov)
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=(5, 3)).astype(np.float32)
    reps = [rng.normal(size=(8, 5, 3)).astype(np.float32) for _ in range(2)]

    def two(anchor, r1, r2):
        st = outer.init(anchor)
        a1, st = L.outer_step(anchor, r1[0], st, outer, "dp", 8)
        a2, st = L.outer_step(a1, r2[0], st, outer, "dp", 8)
        return a1, a2
    a1, a2 = jax.jit(jax.shard_map(two, mesh=mesh, in_specs=(P(), P("dp"), P("dp")),
                                   out_specs=(P(), P())))(x0, *reps)
    x, u = x0, 0
    for r, got in zip(reps, (a1, a2)):
        delta = x - r.mean(0)
        u = beta * u + delta
        x = x - lr * ((beta * u + delta) if nesterov else u)
        np.testing.assert_allclose(np.asarray(got), x, rtol=1e-5, atol=1e-6)


def test_sync_schedule():
    got = [bool(L.is_sync(t, 4)) for t in range(9)]
    assert got == [False, False, False, True, False, False, False, True, False]
    post = [bool(L.is_sync(t, 3, warmup=2)) for t in range(8)]
    assert post == [True, True, False, False, True, False, False, True]
    assert L.syncs(8, 3, 2) == sum(post) and L.syncs(100, 4) == 25
    with pytest.raises(ValueError, match="local_steps must be >= 1"):
        L.is_sync(0, 0)
    with pytest.raises(ValueError, match="momentum in"):
        L.outer_optimizer(0.7, 1.0, True)


def test_census_is_one_parameter_all_reduce_per_h_steps(diloco2):
    (s, step, _), H = diloco2, 2
    text, mesh = step.as_text(), s.placement.mesh
    # DP's gradient all-reduce per step: its formula (test_census holds it to DP's census)
    size = sum(x.size for x in jax.tree.leaves(s.model.abstract_params))
    dp_grad = sum(c.bytes for c in plan.collectives(s.placement.spec.with_(local_sgd="none"))
                  if c.kind == "all-reduce" and c.bytes > 4)
    assert dp_grad == 4 * size
    inner = inspect.census(text, mesh, [1.0, 0.0])           # a step without the average
    assert inner == [{"kind": "all-reduce", "axes": ["dp"], "count": 1, "bytes": 20,
                      "wire_bytes": 35}]                      # the metrics, nothing else
    avg = inspect.census(text, mesh, local_sgd.branch_share(s.placement.spec))
    assert len(avg) == 1 and avg[0]["axes"] == ["dp"]
    assert avg[0]["bytes"] - 20 == dp_grad / H
    theory = inspect.theory_vs_census(plan.collectives(s.placement.spec), avg)
    assert [r["ratio"] for r in theory] == [1.0]


def test_compiled_memory_is_the_planners(diloco2):
    """Arguments and outputs to the byte; temp within `validation.TOLERANCE` (15%): the
    average's phase holds five fp32 copies of the replica (the changes, their sum, the mean and
    the outer step's two results), more than the inner step's backward."""
    from jaxscale.analysis import validation
    s, step, _ = diloco2
    mem = step.memory_analysis()
    xla = planner.predict(s.cfg).memory.xla
    assert xla["argument"] + xla["output"] == pytest.approx(
        mem.argument_size_in_bytes + mem.output_size_in_bytes, rel=1e-3)
    assert abs(xla["temp"] / mem.temp_size_in_bytes - 1) <= validation.TOLERANCE["temp"]
    size = sum(x.size for x in jax.tree.leaves(s.model.abstract_params))
    assert mem.temp_size_in_bytes > 4.5 * 4 * size          # the average's five copies


@pytest.mark.parametrize("extra", [
    ("plan.compression=int8",),
    ("plan.compression=powersgd", "plan.compression_rank=2", "plan.outer_fragments=2",
     "plan.outer_delay=1", "model.n_layers=4")], ids=["blocking int8", "streamed PowerSGD"])
def test_a_compressed_average_holds_one_more_replica(extra):
    """A compressed average's phase holds one replica-sized fp32 buffer beyond the plain
    average's: blocking with int8, the dequantized mean beside the changes; streamed with
    PowerSGD, the reconstruction beside the group's parts. The planner's temp within 2% of the
    compiled on dp8 (generated seed 1214 and these: 0.83-0.85 without it)."""
    cfg = tiny_config(*DP8, *DILOCO, *extra)
    temp = build(cfg).lower_train_step().compile().memory_analysis().temp_size_in_bytes
    assert planner.predict(cfg).memory.xla["temp"] == pytest.approx(temp, rel=0.02)


def test_resume_mid_period_continues_identically(diloco2, tmp_path):
    """Saved after step 3 (one average done, the outer momentum set, replicas one step apart)."""
    s, step, init = diloco2
    ref_losses, ref, _ = run(s, 5, fresh(s, init), step=step)
    _, _, state = run(s, 3, fresh(s, init), step=step)
    ck = ckpt_lib.Checkpointer(tmp_path, CheckpointConfig(async_save=False))
    ck.save(3, state, {"step": 3})
    ck.close()
    mid = host(state)
    assert not np.array_equal(jax.tree.leaves(mid.comm["params"])[0][0],
                              jax.tree.leaves(mid.params)[0])
    ck = ckpt_lib.Checkpointer(tmp_path, s.cfg.ckpt, read_only=True)
    restored = ck.restore(3, s.abstract_state())
    assert jax.tree.all(jax.tree.map(np.array_equal, host(restored), mid))
    losses, got, _ = run(s, 2, restored, start=3, step=step)
    assert losses == ref_losses[3:]
    assert jax.tree.all(jax.tree.map(np.array_equal, got, ref))


def test_replicas_that_are_fsdp_tp_groups_equal_dp_on_the_same_mesh():
    """Each dp rank a replica sharded over fsdp2 x tp2 (the data region is manual over dp only):
    local SGD at H = 1 with the linear inner SGD is DP's step on the same mesh, 3 updates."""
    mesh = ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2")
    dp = numerics.run((*mesh, *SGD))
    local = numerics.run((*mesh, *SGD, "plan.local_sgd=local", "plan.local_steps=1"))
    numerics.assert_matches(local, dp, dataclasses.replace(
        numerics.FP32, grads=None, why="the same fp32 steps; local SGD's step shows no mean "
        "gradient, the weights after each update are compared"))
    # the census is the formula row by row: the average over dp, and inside each replica
    # fsdp's gradient reduction and gathers and tp's activations, as in any step
    spec = plan.Spec.from_config(tiny_config(
        *mesh, *SGD, "plan.local_sgd=local", "plan.local_steps=1"),
        8).with_(device_kind="cpu")
    rows = inspect.theory_vs_census(plan.collectives(spec), inspect.census(
        local.text, local.setup.placement.mesh, plan.branch_share(spec)))
    assert {tuple(r["axes"]) for r in rows} == {("dp",), ("fsdp",), ("tp",)}
    for r in rows:
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=1e-3), r


HSDP = ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2")
DILOCO = ("plan.local_sgd=diloco", "plan.local_steps=2")
#: PowerSGD rank 2 of the parameter changes of 2 AdamW steps (about lr x sign(g) per element:
#: nearly full rank): the projection carries a small part, the rest waits in error feedback, so
#: the replicas' anchor lags uncompressed DiLoCo's; measured 4.4e-2 on the loss after 2 averages.
POWERSGD_OUTER = dataclasses.replace(numerics.COMPRESSION["powersgd"], loss=1e-1,
                                     why="rank-2 outer changes, the rest in error feedback")


@pytest.fixture(scope="module")
def diloco_hsdp():
    """Uncompressed DiLoCo on dp2 x fsdp2 x tp2, 4 updates (2 averages)."""
    return numerics.run((*HSDP, *DILOCO), steps=4)


@pytest.mark.parametrize("method", ["int8", "powersgd"])
def test_diloco_averages_its_parameter_changes_through_compression(method, diloco_hsdp):
    """DiLoCo whose replicas are fsdp2 x tp2 groups, its outer average through the compressed
    mean (the method's state beside the replicas'): 4 updates track uncompressed DiLoCo within
    the method's tolerance, and the census is the formula row by row (the method's collectives
    over dp at 1/H, nothing else over dp but the metrics)."""
    comp = (f"plan.compression={method}",) + (
        ("plan.compression_rank=2",) if method == "powersgd" else ())
    got = numerics.run((*HSDP, *DILOCO, *comp), steps=4)
    worst = numerics.assert_matches(got, diloco_hsdp, dataclasses.replace(
        numerics.COMPRESSION[method] if method == "int8" else POWERSGD_OUTER, grads=None))
    spec = plan.Spec.from_config(tiny_config(*HSDP, *DILOCO, *comp),
                                 8).with_(device_kind="cpu")
    rows = inspect.theory_vs_census(plan.collectives(spec), inspect.census(
        got.text, got.setup.placement.mesh, plan.branch_share(spec)))
    for r in rows:
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=1e-3), r
    dp = sum(c["wire_bytes"] for c in inspect.census(
        got.text, got.setup.placement.mesh, plan.branch_share(spec)) if c["axes"] == ["dp"])
    plain = sum(c.wire_bytes for c in plan.collectives(spec.with_(compression="none"))
                if c.axes == ("dp",))
    assert dp < {"int8": 0.3, "powersgd": 0.2}[method] * plain     # wire bytes over dp
    print(f"DiLoCo with {method}: vs uncompressed {worst}; dp wire bytes {dp / plain:.3f} of "
          f"fp32's")                                                  # docs/local_sgd.md
    if method == "powersgd":        # its error feedback and Q, one slice per device
        assert "mean" in got.setup.init_state().comm


def test_diloco_through_powersgd_moves_the_anchor_by_a_rank_r_change():
    """DiLoCo's first outer step through PowerSGD rank 2 on dp8 (each device holds whole
    leaves, so the matrices PowerSGD sees are each leaf's last two dimensions): outer Nesterov
    from zero momentum scales the compressed mean P Q^T, so the anchor's change is rank 2 in
    every matrix whose dimensions exceed 2. A plain mean's change is full rank (measured
    sv3/sv1 0.2-0.9); no outer step leaves the anchor where it was."""
    got = numerics.run((*DP8, *DILOCO, "plan.compression=powersgd", "plan.compression_rank=2"),
                       steps=2)
    matrices = 0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got.params[1])[0],
                            jax.tree.leaves(got.initial)):
        d = np.asarray(a - b, np.float64)
        if d.ndim < 2 or min(d.shape[-2:]) <= 2:
            continue
        sv = np.linalg.svd(d.reshape(-1, *d.shape[-2:]), compute_uv=False)
        assert sv[:, 0].min() > got.lr, jax.tree_util.keystr(path)       # it moved
        assert (sv[:, 2] <= 1e-3 * sv[:, 0]).all(), (jax.tree_util.keystr(path),
                                                     (sv[:, 2] / sv[:, 0]).max())
        matrices += 1
    assert matrices == 9


def test_diloco_keeps_its_outer_state_in_host_memory(diloco_hsdp):
    """`plan.offload=optimizer` with DiLoCo: the outer momentum (touched once every H steps)
    lives in host memory between steps, as OpenDiLoCo keeps it on the CPU; 4 updates equal
    DiLoCo's on the device bit for bit, and the program's host-resident entry parameters are
    the outer momentum's leaves, the planner's host bytes."""
    got = numerics.run((*HSDP, *DILOCO, "plan.offload=optimizer"), steps=4)
    numerics.assert_matches(got, diloco_hsdp, dataclasses.replace(
        numerics.FP32, grads=None, loss=0.0, params_max=0.0, params_mean=0.0,
        why="the same program on the device; only where the outer state waits differs"))
    outer = [x for x in jax.tree.leaves(got.setup.abstract_state().opt_state) if x.ndim]
    assert outer and all(x.sharding.memory_kind == "pinned_host" for x in outer)
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", got.text).group(1)
    host = [p for p in hlo._split_top(re.sub(r"/\*.*?\*/", "", layout)) if "S(5)" in p]
    shards = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in outer)
    assert len(host) == len(outer)
    assert sum(hlo.nbytes(hlo.shapes(p)) for p in host) == shards
    cfg = tiny_config(*HSDP, *DILOCO, "plan.offload=optimizer")
    assert planner.predict(cfg, 8).memory.host == {"optimizer": shards}


@pytest.mark.parametrize("overrides, message", [
    (("plan.local_sgd=local", "plan.local_steps=0"), "plan.local_steps"),
    (("mesh.dp=1", "mesh.fsdp=8", "mesh.tp=1", "plan.local_sgd=local"),
     "trains replicas over mesh.dp, but mesh.dp=1: give the devices to dp"),
    ((*DP8, "plan.local_sgd=local", "plan.zero=1"), "split one optimizer state over those"),
    ((*DP8, "plan.local_sgd=post_local"), "needs plan.local_warmup >= 1"),
    ((*DP8, "plan.local_sgd=local", "plan.local_warmup=5"), "applies to plan.local_sgd=post_"),
    ((*DP8, "plan.local_sgd=local", "plan.outer_momentum=0.9"), "use plan.local_sgd=slowmo"),
    ((*DP8, "plan.local_sgd=adam"), "plan.local_sgd"),
])
def test_plans_local_sgd_cannot_run_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        plan.validate(tiny_config(*overrides), 8)
