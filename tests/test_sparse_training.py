"""Sparse training in the train step: pruning masks (magnitude, 2:4) that hold after every update
on a parallel plan, distillation from a frozen teacher restored from a checkpoint, and the sparse
embedding-gradient exchange over dp (equal to the dense all-reduce, fewer bytes in the census)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale import plan
from jaxscale.analysis import inspect
from jaxscale.analysis.validation import tiny_config
from jaxscale.strategies import prune, sparse_embedding
from jaxscale.strategies.prune import masking as prune_step
from jaxscale.strategies.tables.params import contracted_axes
from jaxscale.train.setup import build
from tests import numerics

DP8 = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1")
MIX = ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2")


def batch(i=0, B=8, T=32):
    r = np.random.default_rng(i)
    b = {k: r.integers(0, 300, (B, T)).astype(np.int32) for k in ("inputs", "targets")}
    return {**b, "mask": np.ones((B, T), np.float32)}


def run(s, steps, state=None, fixed=False, exe=None):
    """`steps` train steps (the compiled `exe` if given); (state, metrics per step)."""
    state = s.init_state() if state is None else state
    fn, out = exe or s.train_step, []
    with jax.set_mesh(s.placement.mesh):
        for i in range(steps):
            state, m = fn(state, jax.device_put(batch(0 if fixed else i), s.batch_shardings()))
            out.append(jax.device_get(m))
    return state, out


def pruned(params, logical):
    return [(jax.tree_util.keystr(p), tuple(n), np.asarray(w)) for (p, w), n in
            zip(jax.tree_util.tree_flatten_with_path(params)[0],
                jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P)))
            if prune.is_pruned(p, n)]


# ----------------------------------------------------------------------------- pruning
@pytest.fixture(scope="module")
def magnitude_mix():
    """Magnitude pruning on dp2 x fsdp2 x tp2 in bf16 (fp32 master), the cubic ramp reaching
    75 % at update 3; the working parameters and the master after each step."""
    s = build(tiny_config(*MIX, "plan.prune=magnitude", "plan.prune_sparsity=0.75",
                          "plan.prune_start=1", "plan.prune_end=3", "plan.precision=bf16"))
    exe = s.lower_train_step().compile()
    states = []
    state = s.init_state()
    for _ in range(3):
        state, _ = run(s, 1, state, exe=exe)
        states.append((jax.tree.map(lambda a: np.asarray(a, np.float32), state.params),
                       jax.tree.map(np.asarray, state.master)))
    return s, exe, states


def test_magnitude_sparsity_exact_after_each_step_on_parallel_plan(magnitude_mix):
    s, _, states = magnitude_mix
    for step, both in enumerate(states, start=1):
        target = float(prune_step.target_sparsity(s.placement.spec, step))
        assert target == pytest.approx([0.0, 0.75 * (1 - 0.5 ** 3), 0.75][step - 1])
        for params in both:                                 # bf16 parameters, fp32 master
            layers = pruned(params, s.model.logical)
            assert {n for n, _, _ in layers} >= {"['layers']['attn']['wq']",
                                                 "['layers']['mlp']['w_down']"}
            for name, _, w in layers:
                for i in range(w.shape[0]):                 # each layer its own matrix
                    zeros = int(np.sum(w[i] == 0))
                    assert zeros == round(np.float32(target) * w[i].size), (step, name, i, zeros)
    # not pruned: embedding, head, norms
    last = states[-1][0]
    for key in ("embed", "head"):
        assert np.mean(last[key] == 0) < 0.01
    assert np.all(last["layers"]["attn_norm"]["scale"] != 0)


def test_sharded_masks_equal_global_masks_and_census_is_the_formula(magnitude_mix):
    s, exe, states = magnitude_mix
    spec = s.placement.spec
    rng = np.random.default_rng(3)
    pick = lambda t: {"layers": {"attn": {"wq": t["layers"]["attn"]["wq"]},  # noqa: E731
                                 "mlp": {"w_down": t["layers"]["mlp"]["w_down"]}}}
    params = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32),
                          pick(s.model.abstract_params))
    specs, logical = pick(s.layout.specs.shards), pick(s.model.logical)
    sharded = jax.tree.map(lambda a, sp: jax.device_put(a, NamedSharding(s.placement.mesh, sp)),
                           params, specs, is_leaf=lambda x: isinstance(x, P))
    local = prune_step.pruner(spec, logical, s.placement.mesh, specs)
    glob = prune_step.pruner(spec, logical)
    with jax.set_mesh(s.placement.mesh):
        a = jax.jit(local)(sharded, jnp.int32(2))
    b = jax.jit(glob)(params, jnp.int32(2))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    census = inspect.census(exe.as_text(), s.placement.mesh)
    rows = {(r["kind"], tuple(r["axes"])): r for r in
            inspect.theory_vs_census(plan.collectives(spec), census)}
    gather = rows[("all-gather", ("fsdp", "tp"))]        # the sort's gather of each matrix
    assert gather["theory_bytes"] == gather["census_bytes"] > 0


def test_pruning_costs_the_gathered_matrices_and_at_most_its_unmasked_shards(magnitude_mix):
    """Magnitude pruning's temporaries, derived by hand from the shapes: each block matmul weight
    gathered whole for its sort (every layer's at once, fp32 master: 4 bytes per pruned weight)
    and the update's unmasked fp32 shards (split 4 ways on dp2 x fsdp2 x tp2: 1 byte more).
    The compiled temp grows over the same plan unpruned by the gathered matrices at least and
    by both at most (XLA holds the unmasked shards beside them in fp32 on this mesh, not with a
    bf16 master); the planner's term is both (a sort of the largest matrix alone, the term
    before, was 10x short)."""
    s, exe, _ = magnitude_mix
    n = sum(math.prod(a.shape) for (path, a), names in zip(
        jax.tree_util.tree_flatten_with_path(s.model.abstract_params)[0],
        jax.tree.leaves(s.model.logical, is_leaf=lambda x: isinstance(x, P)))
        if prune.is_pruned(path, names))
    dense = build(tiny_config(*MIX, "plan.precision=bf16")).lower_train_step().compile()
    grown = (exe.memory_analysis().temp_size_in_bytes
             - dense.memory_analysis().temp_size_in_bytes)
    assert 4 * n <= grown <= 1.01 * 5 * n
    terms = prune.memory(s.placement.spec)
    assert {t.row for t in terms} == {"backward", "update"}
    assert all(t.bytes == 5 * n for t in terms)


def test_zero1_masks_its_shards_before_the_gather():
    """2:4 under ZeRO-1 in fp32 (no master: the working weights are updated on their dp shards):
    each weight is masked on its shard and gathered over dp once, so the step's dp all-gathers
    move at most every parameter's model-layout shard once (fp32); masked after the gather,
    XLA gathered the block weights twice (the weights for the mask, then the product)."""
    s = build(tiny_config(*MIX, "plan.zero=1", "plan.prune=2:4"))
    exe = s.lower_train_step().compile()
    spec = s.placement.spec
    census = inspect.census(exe.as_text(), s.placement.mesh)
    rows = {(r["kind"], tuple(r["axes"])): r for r in
            inspect.theory_vs_census(plan.collectives(spec), census)}
    gather = rows[("all-gather", ("dp",))]
    once = 4 * sum(math.prod(a.shape) / math.prod(
        spec.deg(m) for e in sp for m in ((e,) if isinstance(e, str) else e or ()))
        for a, sp in zip(jax.tree.leaves(s.model.abstract_params),
                         jax.tree.leaves(s.layout.specs.model, is_leaf=lambda x: isinstance(x, P))))
    assert gather["census_bytes"] == pytest.approx(gather["theory_bytes"], rel=0.02)
    assert 0 < gather["census_bytes"] <= once
    state, _ = run(s, 1, exe=exe)          # initialised dense: the step's masks alone
    for name, names, w in pruned(jax.tree.map(np.asarray, state.params), s.model.logical):
        groups = np.moveaxis(w, contracted_axes(names)[-1], -1).reshape(-1, 4)
        assert np.all(np.sum(groups != 0, axis=1) == 2), name


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_splits_a_pruned_weight_where_its_groups_stay_whole(zero):
    """2:4 under ZeRO-1/2 on dp4 x tp2 with heads 8 wide: the first dimension dp divides in wo
    is head_dim, 2 per device, half a group (refused before: generated seed 1185), so ZeRO
    splits its embed dimension (16 per device) instead. The state is laid out as the planner's
    target partition of every pruned weight; 3 updates match one device's; after each, exactly
    2 of every 4 input weights are kept; the census is the formula."""
    shape = ("model.dim=64", "model.n_heads=8", "model.n_kv_heads=4", "plan.prune=2:4")
    over = (*shape, "mesh.dp=4", "mesh.fsdp=1", "mesh.tp=2", f"plan.zero={zero}")
    spec = plan.validate(tiny_config(*over), 8)
    by_path = {leaf.path: leaf for leaf in prune.pruned_leaves(spec.model)}
    assert tuple(prune.target_partition(spec, by_path["layers/attn/wo"])) == (
        None, "tp", None, "dp")                 # [layers, heads, head_dim, embed]
    got = numerics.run(over)
    layout, checked = got.setup.layout.specs, set()
    for (path, sp), names in zip(
            jax.tree_util.tree_flatten_with_path(layout.shards,
                                                 is_leaf=lambda x: isinstance(x, P))[0],
            jax.tree.leaves(got.setup.model.logical, is_leaf=lambda x: isinstance(x, P))):
        if prune.is_pruned(path, names):
            key = jax.tree_util.keystr(path, simple=True, separator="/")
            assert tuple(sp) == tuple(prune.target_partition(spec, by_path[key])), key
            checked.add(key)
    assert checked == set(by_path)
    numerics.assert_matches(got, numerics.one_device(*shape), numerics.PRUNED)
    for params in got.params:
        for name, names, w in pruned(params, got.setup.model.logical):
            groups = np.moveaxis(w, contracted_axes(names)[-1], -1).reshape(-1, 4)
            assert np.all(np.sum(groups != 0, axis=1) == 2), name
    census = inspect.census(got.text, got.setup.placement.mesh)
    for r in inspect.theory_vs_census(plan.collectives(spec), census):
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=0.02), r


# ----------------------------------------------------------------------------- sparse embedding
@pytest.fixture(scope="module")
def exchanges():
    """The same dp8 training with the dense gradient all-reduce and the sparse embedding one."""
    out = {}
    for name, extra in (("dense", ()), ("sparse", ("plan.sparse_embedding=true",))):
        s = build(tiny_config(*DP8, *extra))
        exe = s.lower_train_step().compile()
        init = s.init_state()
        if name == "dense":       # kept (the step donates its state): the teacher's weights
            out["init"] = jax.tree.map(jnp.copy, init)
        state, ms = run(s, 2, init, exe=exe)
        out[name] = (s, exe, jax.tree.map(np.asarray, state.params), ms)
    return out


def test_sparse_embedding_equals_dense_exchange(exchanges):
    (_, _, pd, md), (_, _, ps, ms) = exchanges["dense"], exchanges["sparse"]
    np.testing.assert_allclose([m["loss"] for m in ms], [m["loss"] for m in md], rtol=1e-6)
    np.testing.assert_allclose([m["grad_norm"] for m in ms], [m["grad_norm"] for m in md],
                               rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ps), jax.tree.leaves(pd)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.any(ps["embed"] != np.asarray(exchanges["init"].params["embed"]))  # it moved


def test_sparse_embedding_census_is_the_formula_and_fewer_bytes(exchanges):
    s, exe, _, _ = exchanges["sparse"]
    spec = s.placement.spec
    census = inspect.census(exe.as_text(), s.placement.mesh)
    n, R, D = 8, sparse_embedding.rows(spec), spec.model.dim
    assert R == 32                                 # 1 sequence x 32 tokens per device < 320
    gather = [r for r in census if r["kind"] == "all-gather"]
    # on the wire, a ring all-gather brings each device the other n - 1 devices' parts
    assert gather == [dict(kind="all-gather", axes=["dp"], count=2, bytes=4 * n * R * (D + 1),
                           wire_bytes=4 * (n - 1) * R * (D + 1))]
    for r in inspect.theory_vs_census(plan.collectives(spec), census):
        assert r["census_bytes"] == r["theory_bytes"], r
    dense = inspect.census(exchanges["dense"][1].as_text(), s.placement.mesh)
    reduce = lambda c: sum(r["bytes"] for r in c if r["kind"] == "all-reduce")
    # the embedding's all-reduce (4 V D) left the all-reduce; the data region sums the loss and
    # the token count as one [2] fp32 array (8 bytes), where the dense step's 4-byte count rides
    # in a tuple of scalars (0 bytes in the census)
    assert reduce(dense) - reduce(census) + 8 == sparse_embedding.dense_bytes(spec) == 4 * 320 * D
    assert gather[0]["bytes"] < sparse_embedding.dense_bytes(spec)
    assert sum(r["bytes"] for r in census) < sum(r["bytes"] for r in dense)


@pytest.mark.parametrize("mesh, other", [
    (("mesh.dp=2", "mesh.ep=2", "mesh.fsdp=1", "mesh.tp=2", "model.moe_experts=4"), ("ep",)),
    (("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2"), ("fsdp",))], ids=["ep", "fsdp"])
def test_sparse_embedding_gathers_its_replicas_ids_over_the_other_data_axes(mesh, other):
    """Where ep or fsdp split the batch beside dp, the exchange (on each device's own shards,
    for its dp replica's rows) reads the token ids of the whole replica: they are gathered over
    those axes, 4 B_dp T bytes (generated seeds 1013 and 1165: 256 and 1,536 B over ep the
    formula had not)."""
    s = build(tiny_config(*mesh, "plan.sparse_embedding=true"))
    spec = s.placement.spec
    census = inspect.census(s.lower_train_step().compile().as_text(), s.placement.mesh)
    rows = {(r["kind"], tuple(r["axes"])): r
            for r in inspect.theory_vs_census(plan.collectives(spec), census)}
    ids = [c for c in sparse_embedding.collectives(spec) if c.axes == other]
    assert [c.bytes for c in ids] == [4 * spec.batch // 2 * spec.seq]
    got = rows[("all-gather", other)]
    assert got["census_bytes"] == pytest.approx(got["theory_bytes"], rel=0.02)


# ----------------------------------------------------------------------------- distillation
@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, exchanges):
    """A run directory (config.json + checkpoints/0) holding the dp8 model's initial state."""
    from jaxscale import config as config_lib
    from jaxscale.train import checkpoint as ckpt_lib
    from jaxscale.train import checkpoint_meta as ckpt_meta
    out = tmp_path_factory.mktemp("teacher")
    s, state = exchanges["dense"][0], exchanges["init"]
    ck = ckpt_lib.Checkpointer(out / "checkpoints", config_lib.CheckpointConfig(async_save=False))
    # the metadata a run writes, less the checksums (a restore then skips verifying them)
    ck.save(0, state, {"step": 0, "config": config_lib.to_dict(s.cfg),
                       "leaves": ckpt_meta.leaf_signature(state)})
    ck.wait()
    ck.close()
    config_lib.save(s.cfg, out / "config.json")
    return out


def test_distillation_and_two_four_pruning_on_parallel_plan(teacher_dir):
    """The student (dp2 x fsdp2 x tp2, 2:4 pruned) starts from the teacher's weights: KL = 0 at
    temperature 1; it then trains (loss falls), the teacher stays frozen, and after each update
    exactly 2 of every 4 input weights of each block matrix are kept."""
    s = build(tiny_config(*MIX, "plan.prune=2:4", f"train.teacher={teacher_dir}",
                          "train.distill_temperature=1", "train.distill_alpha=0.5",
                          "train.steps=4"))
    assert s.teacher.where.endswith("checkpoints/0")
    t0 = s.teacher.params["layers"]["attn"]["wq"]
    assert t0.sharding.spec == s.device_shardings.params["layers"]["attn"]["wq"].spec
    state, ms = run(s, 4, fixed=True)
    assert abs(float(ms[0]["distill_kd"])) < 1e-6          # teacher == student: KL = 0
    assert float(ms[-1]["distill_kd"]) > 1e-6              # the student moved away
    assert ms[-1]["loss"] < ms[0]["loss"]                  # and it learns
    np.testing.assert_array_equal(np.asarray(s.teacher.params["layers"]["attn"]["wq"]),
                                  np.asarray(t0))          # the teacher is frozen
    for name, names, w in pruned(jax.tree.map(np.asarray, state.params), s.model.logical):
        ax = contracted_axes(names)[-1]
        groups = np.moveaxis(w, ax, -1).reshape(-1, 4)
        assert np.all(np.sum(groups != 0, axis=1) == 2), name     # exactly 2 of every 4 kept
    assert not prune.collectives(s.placement.spec)            # shard-local groups


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("overrides, message", [
    (("plan.prune=magnitude", "plan.prune_sparsity=1.0"), r"plan.prune_sparsity=1.0: must be"),
    (("plan.prune=magnitude", "plan.prune_sparsity=-0.1"), r"plan.prune_sparsity=-0.1: must be"),
    (("plan.prune=2:4", "model.ffn_dim=386"), r"contracted axis 'mlp' \(size 386\), which is not "
                                              r"divisible by 4"),
    (("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=8", "model.n_kv_heads=8", "plan.prune=2:4",
      "model.ffn_dim=392"), r"split 8 ways over the mesh \(tp\), leaving 49 per device"),
    (("plan.prune=4:2",), r"plan.prune='4:2': valid are none, magnitude or N:M"),
    (("plan.prune=magnitude", "plan.prune_start=5", "plan.prune_end=3"), "must be after"),
    (("mesh.dp=1", "mesh.fsdp=8", "mesh.tp=1", "plan.sparse_embedding=true"),
     "over mesh.dp, but mesh.dp=1"),
    ((*DP8, "plan.sparse_embedding=true", "plan.local_sgd=diloco"), "no gradient mean"),
    ((*DP8, "plan.sparse_embedding=true", "model.tie_embeddings=true"), "tied table"),
])
def test_bad_plans_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        plan.validate(tiny_config(*overrides), 8)


def test_bad_teachers_are_refused(teacher_dir, tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        build(tiny_config(*DP8, f"train.teacher={tmp_path / 'missing'}"))
    with pytest.raises(ValueError, match="no finalized checkpoint"):
        build(tiny_config(*DP8, f"train.teacher={tmp_path}"))
    with pytest.raises(ValueError, match="the teacher's vocabulary has 320 entries, the "
                                         "student's 384"):
        build(tiny_config(*DP8, f"train.teacher={teacher_dir}", "model.vocab_size=384"))
    with pytest.raises(ValueError, match="mesh.pp=2: the pipeline engine"):
        build(tiny_config("mesh.dp=4", "mesh.fsdp=1", "mesh.tp=1", "mesh.pp=2",
                          f"train.teacher={teacher_dir}"))
