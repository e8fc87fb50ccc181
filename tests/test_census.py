"""The collective census: kinds, bytes and mesh axes read from the compiled HLO."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale.analysis import hlo, inspect
from jaxscale.mesh import MeshConfig, make_mesh
from jaxscale.strategies.common import Comm
from tests.helpers import PLANS, tiny_config


# ----------------------------------------------------------------------------- replica groups
@pytest.mark.parametrize("text, groups", [
    ("replica_groups={{0,2},{1,3}}, use_global_device_ids=true", [[0, 2], [1, 3]]),
    ("replica_groups=[2,4]<=[8], dimensions={0}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0), x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, use_global",
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, x", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(2,1,0)) "
     "{'axis_2'}, x", [[0, 4], [2, 6], [1, 5], [3, 7]]),
])
def test_replica_group_formats(text, groups):
    got = hlo.replica_groups(text)
    assert sorted(map(sorted, got)) == sorted(map(sorted, groups))


def _compile_shard_map(mesh, f, spec, shape=(8, 64)):
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
    return g.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()


@pytest.mark.parametrize("axes", [("dp",), ("fsdp",), ("tp",), ("dp", "tp"), ("fsdp", "tp")])
def test_census_axes_match_the_collective(axes):
    mesh = make_mesh(MeshConfig(dp=2, fsdp=2, tp=2))
    text = _compile_shard_map(mesh, lambda x: jax.lax.psum(x * 2, axes), P(("dp", "fsdp", "tp")))
    rows = inspect.census(text, mesh)
    assert [(r["kind"], tuple(r["axes"]), r["count"]) for r in rows] == [("all-reduce", axes, 1)]
    assert rows[0]["bytes"] == 64 * 4          # one local row of 64 fp32
    n = 2 ** len(axes)
    assert rows[0]["wire_bytes"] == int(64 * 4 * 2 * (n - 1) / n)


def test_census_counts_loop_trips_and_permutes():
    mesh = make_mesh(MeshConfig(dp=8))

    def f(x):
        def body(c, _):
            c = jax.lax.psum(c, "dp") * 0.1
            return jax.lax.ppermute(c, "dp", [(i, (i + 1) % 8) for i in range(8)]), None
        return jax.lax.scan(body, x, None, length=5)[0]
    rows = inspect.census(_compile_shard_map(mesh, f, P("dp")), mesh)
    kinds = {r["kind"]: r for r in rows}
    assert kinds["all-reduce"]["count"] == 5 and kinds["collective-permute"]["count"] == 5
    assert kinds["collective-permute"]["axes"] == ["dp"]
    assert kinds["all-reduce"]["bytes"] == 5 * 64 * 4


def test_all_gather_and_reduce_scatter_bytes():
    mesh = make_mesh(MeshConfig(fsdp=8))
    text = _compile_shard_map(mesh, lambda x: jax.lax.all_gather(x, "fsdp", tiled=True)[:1] * 0 + x,
                              P("fsdp"))
    ag = [r for r in inspect.census(text, mesh) if r["kind"] == "all-gather"]
    assert ag and ag[0]["bytes"] == 8 * 64 * 4 and ag[0]["axes"] == ["fsdp"]


def test_theory_rows_apart_that_xla_merges_into_one_group_are_named():
    """A census row over (ep, sp) that the theory lacks, where the theory's ep and sp rows each
    carry more than the census: the rows stay as measured (no ratio hides the difference) and
    the notes name the merged group and the rows to merge; a row the theory does carry gets no
    such note."""
    theory = [Comm("all-reduce", ("ep",), 300.0, 2, "norms and weights"),
              Comm("all-reduce", ("sp",), 200.0, 1, "weights over the sequence shards"),
              Comm("all-reduce", ("tp",), 64.0, 1, "activations")]
    observed = [{"kind": "all-reduce", "axes": ["ep"], "bytes": 100},
                {"kind": "all-reduce", "axes": ["ep", "sp"], "bytes": 200},
                {"kind": "all-reduce", "axes": ["tp"], "bytes": 64}]
    rows = {tuple(r["axes"]): r for r in inspect.theory_vs_census(theory, observed)}
    assert [(a, r["theory_bytes"], r["census_bytes"]) for a, r in rows.items()] == [
        (("ep",), 300, 100), (("ep", "sp"), 0, 200), (("sp",), 200, 0), (("tp",), 64, 64)]
    assert rows[("ep", "sp")]["ratio"] is None and rows[("sp",)]["ratio"] == 0
    assert "XLA reduces over (ep, sp) at once, where the theory counts (ep) and (sp) apart" in \
        rows[("ep", "sp")]["note"]
    assert "reduced by XLA over (ep, sp) at once" in rows[("ep",)]["note"]
    assert "reduced by XLA over (ep, sp) at once" in rows[("sp",)]["note"]
    assert rows[("tp",)]["note"] == ""
    exact = [Comm("all-reduce", ("ep", "sp"), 200.0), Comm("all-reduce", ("ep",), 100.0)]
    assert all(r["note"] == "" for r in inspect.theory_vs_census(exact, observed[:2]))


# ----------------------------------------------------------------------------- plans
@functools.lru_cache(maxsize=None)
def _report(plan):
    return inspect.report(tiny_config(*PLANS[plan], "model.n_kv_heads=8"))


def _grad_bytes(rep_cfg_plan):
    import math

    from jaxscale.train.state import FunctionalModel
    return sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(FunctionalModel(
        tiny_config(*PLANS[rep_cfg_plan], "model.n_kv_heads=8").model).abstract_params))


def test_dp_census_is_one_gradient_all_reduce_over_dp():
    rep = _report("dp8")
    assert {(r["kind"], tuple(r["axes"])) for r in rep["collectives"]} == {("all-reduce", ("dp",))}
    # gradients plus a few scalars (token count, loss)
    assert 0 <= rep["collectives"][0]["bytes"] - _grad_bytes("dp8") < 64
    th = [t for t in rep["theory"] if t["kind"] == "all-reduce"][0]
    assert abs(th["ratio"] - 1) < 1e-3


def test_fsdp_census_gathers_params_and_reduces_grads_over_fsdp_only():
    rep = _report("fsdp8")
    assert {tuple(r["axes"]) for r in rep["collectives"]} == {("fsdp",)}
    kinds = {r["kind"]: r for r in rep["collectives"]}
    assert "all-gather" in kinds
    # gradient reduction: reduce-scatter on GPU, all-reduce + slice on XLA:CPU
    red = kinds.get("reduce-scatter") or kinds["all-reduce"]
    assert abs(red["bytes"] - _grad_bytes("fsdp8")) < 64
    # every parameter gathered at least once in the forward: >= full parameter bytes
    assert kinds["all-gather"]["bytes"] >= _grad_bytes("fsdp8") * 7 / 8


def test_tp_census_is_activation_all_reduces_over_tp_only():
    rep = _report("tp8")
    assert {(r["kind"], tuple(r["axes"])) for r in rep["collectives"]} == {("all-reduce", ("tp",))}
    cfg = tiny_config(*PLANS["tp8"])
    B, T, L = cfg.data.batch_size, cfg.data.seq_len, cfg.model.n_layers
    act = B * T * cfg.model.dim * 4
    # Megatron's minimum exactly: per layer 2 forward (attention and MLP outputs) and 2 backward
    # (the q/k/v and the gate/up inputs' gradients, each group reduced once), the vocabulary-
    # split embedding's output and the head's input gradient; and the vocabulary-parallel cross
    # entropy's three [B, T] fp32 reductions (max, sum of exponentials, target logit)
    assert rep["collectives"][0]["count"] == 4 * L + 2 + 3
    assert rep["collectives"][0]["bytes"] == (4 * L + 2) * act + 3 * B * T * 4


def test_report_schema():
    rep = _report("dp2xfsdp2xtp2")
    assert {"memory", "collectives", "flops", "theory"} <= set(rep)
    for c in rep["collectives"]:
        assert set(c) >= {"kind", "count", "bytes", "axes"}
        assert c["kind"] in hlo.COLLECTIVES and set(c["axes"]) <= {"dp", "fsdp", "tp"}
    # memory_analysis() against the state's size by hand: the weights (2 V D embedding and head,
    # per layer 4 D H hd attention and 3 D F MLP) split over fsdp x tp = 4, the norm scales (2 D
    # per layer + D) over fsdp = 2; fp32 parameters, Adam's two moments, three int32 counters
    # (step, two optimizer counts); the batch (inputs, targets, mask: 4 bytes a token) over
    # dp x fsdp = 4. The state is donated: its buffers are the outputs' (alias), and the rest of
    # the output is the scalar metrics.
    cfg = tiny_config(*PLANS["dp2xfsdp2xtp2"], "model.n_kv_heads=8")
    mc, B, T = cfg.model, cfg.data.batch_size, cfg.data.seq_len
    D, V, L, F, H = mc.dim, mc.vocab_size, mc.n_layers, mc.ffn_dim, mc.n_heads
    assert (D, V, L, F, H, mc.n_kv_heads, mc.hd) == (128, 320, 2, 384, 8, 8, 16)
    matrices = 2 * V * D + L * (4 * D * H * 16 + 3 * D * F)
    norms = 2 * L * D + D
    state = 3 * 4 * (matrices // 4 + norms // 2) + 3 * 4
    assert state == 1_527_564
    m = rep["memory"]
    assert m["argument"] == state + 3 * 4 * B * T // 4
    assert m["alias"] == state
    assert 0 < m["output"] - m["alias"] < 1024 and m["temp"] > 0
    # FLOPs: the HLO's matmul FLOPs equal the non-causal model formula (xla attention
    # computes the masked half too) plus the embedding gradient's one-hot matmul (2 V/tp D per
    # local token: tp=2 splits the vocabulary)
    tokens = B * T
    dense = cfg.model.flops_per_token(cfg.data.seq_len, causal=False) * tokens / 8
    one_hot = 2 * cfg.model.vocab_size / 2 * cfg.model.dim * tokens / 4
    assert abs(rep["flops"]["dot_flops"] / (dense + one_hot) - 1) < 0.02
    assert np.isfinite(rep["flops"]["xla_cost_analysis_flops"])


def test_float16_on_cpu_is_counted_as_bf16_is():
    """XLA:CPU widens bf16 collectives to f32 but carries float16 ones as they are (and moves
    some converts across them): the census counts f16 at 4 bytes under a float16 policy
    (`precision.cpu_widened`), so an fp16 plan moves what its bf16 twin moves, row by row, and
    both are their formula's. Counted as moved, fp16's dp all-reduce is ~0.6 of it."""
    from jaxscale import plan
    from jaxscale.strategies import precision
    from jaxscale.train.setup import build
    rows = {}
    for p in ("bf16", "fp16"):
        cfg = tiny_config(*PLANS["dp2xfsdp2xtp2"], f"plan.precision={p}")
        rep = inspect.report(cfg)
        rows[p] = {(r["kind"], tuple(r["axes"])): r["bytes"] for r in rep["collectives"]}
        for r in rep["theory"]:
            assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=0.02), (p, r)
    assert rows["fp16"] == rows["bf16"]
    setup = build(tiny_config(*PLANS["dp2xfsdp2xtp2"], "plan.precision=fp16"))
    assert precision.cpu_widened(setup.placement.spec) == ("f16",)
    text = setup.lower_train_step().compile().as_text()
    raw = {(r["kind"], tuple(r["axes"])): r["bytes"] for r in inspect.census(
        text, setup.placement.mesh, plan.branch_share(setup.placement.spec))}
    assert raw[("all-reduce", ("dp",))] < 0.7 * rows["fp16"][("all-reduce", ("dp",))]
    # fp8 QAT's e4m3 operands, widened to f16 by XLA:CPU, count as the formulas' widened f16
    rep = inspect.report(tiny_config(*PLANS["dp2xfsdp2xtp2"], "plan.precision=fp16",
                                     "plan.qat=fp8"))
    for r in rep["theory"]:
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=0.02), ("fp8", r)
