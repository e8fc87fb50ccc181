"""Hand-written collectives against the built-ins, the alpha-beta model, the benchmark's
accounting."""
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale import cost as cost_lib
from jaxscale.comm import algorithm_cost as CM
from jaxscale.comm import algorithms as C
from jaxscale.comm import bench, bench_sweep, torch_bench
from jaxscale.mesh import MeshConfig, make_mesh


def mesh1(n):
    return make_mesh(MeshConfig(dp=n), devices=jax.devices()[:n])


def rand(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def per_device(fn, mesh, axes):
    """Built-in reference with the wrappers' convention: x[k] in, device k's result [k] out."""
    spec = P(axes)
    return jax.jit(jax.shard_map(lambda b: fn(b[0])[None], mesh=mesh, in_specs=spec,
                                 out_specs=spec))


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# numerics: each hand-written collective equals the built-in one
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "recursive_doubling"])
@pytest.mark.parametrize("local_shape", [(5,), (3, 13), (64,)])
def test_all_reduce_equals_psum(n, algorithm, local_shape):
    mesh = mesh1(n)
    x = rand((n,) + local_shape, seed=n)
    got = C.all_reduce(x, mesh, "dp", algorithm)
    close(got, per_device(lambda b: jax.lax.psum(b, "dp"), mesh, "dp")(x))
    close(got[0], x.sum(0))


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("axis", [0, 1])
def test_ring_reduce_scatter_equals_psum_scatter(n, axis):
    mesh = mesh1(n)
    local = (2 * n, 3) if axis == 0 else (3, 2 * n)
    x = rand((n,) + local, seed=1)
    ref = per_device(lambda b: jax.lax.psum_scatter(b, "dp", scatter_dimension=axis, tiled=True),
                     mesh, "dp")(x)
    body = per_device(lambda b: C.ring_reduce_scatter(b, "dp", axis=axis), mesh, "dp")
    close(body(x), ref)
    if axis == 0:
        close(C.reduce_scatter(x, mesh, "dp"), ref)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("axis", [0, 1])
def test_ring_all_gather_equals_all_gather(n, axis):
    mesh = mesh1(n)
    x = rand((n, 3, 5), seed=2)
    ref = per_device(lambda b: jax.lax.all_gather(b, "dp", axis=axis, tiled=True), mesh, "dp")(x)
    got = per_device(lambda b: C.ring_all_gather(b, "dp", axis=axis), mesh, "dp")(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))  # pure data movement
    if axis == 0:
        np.testing.assert_array_equal(np.asarray(C.all_gather(x, mesh, "dp")), np.asarray(ref))


@pytest.mark.parametrize("outer_n,inner_n", [(2, 4), (4, 2)])
@pytest.mark.parametrize("outer", ["ring", "halving_doubling", "psum"])
def test_hierarchical_equals_psum_over_both_axes(outer_n, inner_n, outer):
    mesh = make_mesh(MeshConfig(dp=outer_n, fsdp=inner_n, dcn_dp=outer_n))
    x = rand((8, 7, 3), seed=3)  # 21 elements: padding to a multiple of inner_n exercised
    body = lambda b: C.hierarchical_all_reduce(b, "fsdp", "dp", outer=outer)  # noqa: E731
    got = per_device(body, mesh, ("dp", "fsdp"))(x)
    ref = per_device(lambda b: jax.lax.psum(b, ("dp", "fsdp")), mesh, ("dp", "fsdp"))(x)
    close(got, ref)
    if outer == "ring":
        close(C.all_reduce(x, mesh, ("dp", "fsdp"), "hierarchical"), ref)


def test_ring_over_two_axes_at_once():
    mesh = make_mesh(MeshConfig(dp=2, tp=4))
    x = rand((8, 10), seed=4)
    close(C.all_reduce(x, mesh, ("dp", "tp"), "ring"), np.broadcast_to(x.sum(0), (8, 10)))


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["halving_doubling", "recursive_doubling"])
def test_power_of_two_algorithms_reject_other_sizes(algorithm):
    mesh = mesh1(6)
    with pytest.raises(ValueError, match="power-of-two axis size.*'dp' has 6 devices"):
        C.all_reduce(rand((6, 4)), mesh, "dp", algorithm)
    close(C.all_reduce(rand((6, 4)), mesh, "dp", "ring"), np.broadcast_to(rand((6, 4)).sum(0),
                                                                          (6, 4)))


def test_bad_arguments_are_named():
    mesh = mesh1(4)
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'tree'"):
        C.all_reduce(rand((4, 3)), mesh, "dp", "tree")
    with pytest.raises(ValueError, match="needs two axes"):
        C.all_reduce(rand((4, 3)), mesh, "dp", "hierarchical")
    with pytest.raises(ValueError, match=r"expected a global array of shape \(4, ...\)"):
        C.all_reduce(rand((3, 3)), mesh, "dp")
    with pytest.raises(ValueError, match="not divisible by the 4 devices"):
        C.reduce_scatter(rand((4, 6)), mesh, "dp")
    with pytest.raises(ValueError, match="unknown outer algorithm"):
        per_device(lambda b: C.hierarchical_all_reduce(b, "dp", "tp", outer="star"), mesh, "dp")(
            rand((4, 4)))


# --------------------------------------------------------------------------------------------
# the compiled program holds only collective-permutes
# --------------------------------------------------------------------------------------------
def _ops(fn, x):
    text = fn.lower(x).compile().as_text()
    return re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|"
                      r"collective-permute)(?:-start)?\(", text)


@pytest.mark.parametrize("algorithm,steps", [("ring", 14), ("halving_doubling", 6),
                                             ("recursive_doubling", 3)])
def test_hand_written_all_reduce_compiles_to_collective_permutes_only(algorithm, steps):
    mesh = mesh1(8)
    ops = _ops(C.all_reduce_fn(mesh, "dp", algorithm), jnp.zeros((8, 1024)))
    assert ops == ["collective-permute"] * steps
    assert _ops(C.all_reduce_fn(mesh, "dp", "psum"), jnp.zeros((8, 1024))) == ["all-reduce"]


# --------------------------------------------------------------------------------------------
# alpha-beta model
# --------------------------------------------------------------------------------------------
def test_busbw_factors_match_nccl_tests():
    n = 8
    expect = dict(all_reduce=2 * 7 / 8, all_gather=7 / 8, reduce_scatter=7 / 8,
                  all_to_all=7 / 8, broadcast=1.0, permute=1.0)
    assert {k: cost_lib.busbw_factor(k, n) for k in CM.KINDS} == pytest.approx(expect)
    assert cost_lib.busbw_factor("all_reduce", 1) == 0
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'"):
        cost_lib.busbw_factor("allreduce", 8)


def test_cost_model_steps_and_bytes():
    S, n = 1 << 20, 8
    ring = CM.cost("ring", "all_reduce", S, n)
    assert (ring.steps, ring.wire_bytes) == (14, pytest.approx(2 * 7 / 8 * S))
    hd = CM.cost("halving_doubling", "all_reduce", S, n)
    assert (hd.steps, hd.wire_bytes) == (6, pytest.approx(ring.wire_bytes))
    rd = CM.cost("recursive_doubling", "all_reduce", S, n)
    assert (rd.steps, rd.wire_bytes) == (3, 3 * S)
    hi = CM.cost("hierarchical", "all_reduce", S, n, n_inner=4)
    assert hi.steps == 2 * 3 + 2 * 1 and hi.wire_bytes == pytest.approx(ring.wire_bytes)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        c = CM.cost("ring", kind, S, n)
        assert (c.steps, c.wire_bytes) == (7, pytest.approx(7 / 8 * S))
    assert CM.wire_bytes("ring", "broadcast", S, n) == S
    # t = steps * alpha + S * factor / bandwidth
    assert CM.predict_time("ring", "all_reduce", S, n, 1e-5, 1e9) == pytest.approx(
        14 * 1e-5 + S * 2 * 7 / 8 / 1e9)
    assert CM.predict_time("ring", "all_reduce", S, n, 0, 1e9, gamma=1e-9) == pytest.approx(
        S * 2 * 7 / 8 / 1e9 + S * 7 / 8 * 1e-9)
    with pytest.raises(ValueError, match="power-of-two"):
        CM.cost("halving_doubling", "all_reduce", S, 6)
    with pytest.raises(ValueError, match="has no all_to_all"):
        CM.cost("recursive_doubling", "all_to_all", S, 8)
    with pytest.raises(ValueError, match="unknown algorithm"):
        CM.cost("butterfly", "all_reduce", S, 8)
    with pytest.raises(ValueError, match="n_inner dividing"):
        CM.cost("hierarchical", "all_reduce", S, 8, n_inner=3)


def test_two_level_beats_flat_ring_when_inter_node_is_slower():
    S, a, b = 256 << 20, 8, 4
    intra = CM.Link(3e-6, 450e9)
    for inter_bw in (450e9, 100e9, 50e9, 25e9):
        inter = CM.Link(10e-6, inter_bw)
        hier = CM.hierarchical_time(S, a, b, intra, inter)
        flat = CM.flat_ring_time(S, a, b, intra, inter)
        assert hier < flat
    # the gap grows as the inter-node link slows: flat sends all 2(N-1)/N S over it, the
    # hierarchy only 2(b-1)/(ab) S
    slow = CM.Link(10e-6, 25e9)
    ratio = CM.flat_ring_time(S, a, b, intra, slow) / CM.hierarchical_time(S, a, b, intra, slow)
    assert ratio > 5
    # one node: both are the same ring
    assert CM.flat_ring_time(S, 8, 1, intra, slow) == pytest.approx(
        CM.predict_time("ring", "all_reduce", S, 8, intra.alpha, intra.bandwidth))


def test_fit_alpha_beta_recovers_a_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    alpha, bw = CM.fit_alpha_beta(sizes, [2e-5 + s / 3e9 for s in sizes])
    assert alpha == pytest.approx(2e-5) and bw == pytest.approx(3e9)
    with pytest.raises(ValueError, match="do not grow"):
        CM.fit_alpha_beta(sizes, [1e-3, 1e-3, 1e-3, 0.9e-3])


# --------------------------------------------------------------------------------------------
# the benchmark: accounting of a tiny sweep, JAX and torch side by side
# --------------------------------------------------------------------------------------------
FACTORS_2 = dict(all_reduce=1.0, all_gather=0.5, reduce_scatter=0.5, all_to_all=0.5,
                 broadcast=1.0, permute=1.0)


def test_tiny_sweep_accounting(tmp_path):
    cfg = bench_sweep.SweepConfig(min_bytes=1024, max_bytes=4096, factor=2, iters=2, warmup=1,
                                  world=2, timeout=120)
    res = bench_sweep.run_sweep(cfg, log=lambda s: None)
    assert res["torch_error"] is None, res["torch_error"]
    assert res["meta"]["n"] == 2 and res["meta"]["torch_backend"] == "gloo"
    rows = res["rows"]
    for fw in ("jax", "torch"):
        got = {(r["kind"], r["nbytes"]) for r in rows if r["framework"] == fw}
        assert got == {(k, s) for k in torch_bench.KINDS for s in (1024, 2048, 4096)}
    for r in rows:
        assert r["n"] == 2 and len(r["times"]) == 2
        assert r["time_s"] == pytest.approx(float(np.median(r["times"])))
        assert r["algbw"] == pytest.approx(r["nbytes"] / r["time_s"])
        assert r["factor"] == FACTORS_2[r["kind"]]
        assert r["busbw"] == pytest.approx(r["algbw"] * FACTORS_2[r["kind"]])
    ratios = bench.ratios(res)
    assert len(ratios) == len(torch_bench.KINDS) * 3
    by = {(r["framework"], r["kind"], r["nbytes"]): r for r in rows}
    for q in ratios:
        j, t = by["jax", q["kind"], q["nbytes"]], by["torch", q["kind"], q["nbytes"]]
        assert q["ratio"] == pytest.approx(j["busbw"] / t["busbw"])
    algs = {r["algorithm"] for r in res["handwritten"]}
    assert algs == {"psum", "ring", "halving_doubling", "recursive_doubling"}
    for r in res["handwritten"]:
        assert r["vs_psum"] == pytest.approx(r["time_s"] / next(
            p["time_s"] for p in res["handwritten"]
            if p["algorithm"] == "psum" and p["nbytes"] == r["nbytes"]))
    report = bench.format_report(res)
    assert "jax/torch busbw" in report and "all_to_all  (busbw factor 0.500" in report
    js, png = bench.save(res, tmp_path)
    assert json.loads(js.read_text())["ratios"] and png.stat().st_size > 10_000


def test_torch_failure_is_reported_and_jax_still_runs(capsys, tmp_path, monkeypatch):
    # the failure is NCCL's without a GPU: the torch processes are shown none, on any machine
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code = bench.main(["--min-bytes", "1K", "--max-bytes", "1K", "--iters", "1", "--warmup", "0",
                       "--kinds", "all_reduce", "--world", "2", "--torch-backend", "nccl",
                       "--no-handwritten", "--timeout", "60", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "TORCH SIDE FAILED" in out and "exited with status" in out
    assert "the nccl backend needs CUDA GPUs" in out
    assert re.search(r"1 KiB +\d+\.\d+ .*\| +- +- +- \|", out)  # the JAX row is there


def test_bench_rejects_bad_arguments(capsys):
    assert bench.main(["--kinds", "all_reduce,gossip", "--no-torch"]) == 2
    assert "unknown collective kind(s) ['gossip']" in capsys.readouterr().err
    assert bench.main(["--world", "64", "--no-torch", "--max-bytes", "1K"]) == 2
    assert "exceeds the 8 JAX devices" in capsys.readouterr().err
    assert bench_sweep.sizes(1024, 16384, 4) == [1024, 4096, 16384]
    from jaxscale.hardware import simulate_cpu_devices
    assert simulate_cpu_devices(8) is False  # jax is imported already: leave flags alone
    assert math.isclose(cost_lib.busbw_factor("all_gather", 4), 0.75)
