"""Gradient compression: compressed means within their error, error feedback on a quadratic,
PowerSGD exact on low rank, census bytes = the formulas, refusals."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxscale.analysis import inspect
from jaxscale.axes import MESH_AXES
from jaxscale.strategies.compression import formulas as F
from jaxscale.strategies.compression import methods as C
from jaxscale.strategies.compression import powersgd
from tests import numerics

N = 8


@pytest.fixture(scope="module")
def mesh2d():
    return jax.make_mesh((4, 2), ("dp", "fsdp"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def mesh1d():
    return jax.make_mesh((N,), ("dp",), axis_types=(AxisType.Auto,))


def rand(shape, seed=0, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def grads_tree(seed=0):
    """Per-device gradients (leading axis 8): a matrix with rows of very different magnitude
    (per-block scales matter) and an odd-sized vector (padding exercised)."""
    row_scale = np.logspace(-3, 1, 40, dtype=np.float32)[None, :, None]
    return {"w": rand((N, 40, 24), seed) * row_scale, "b": rand((N, 37), seed + 1)}


def flat_n(tree):
    return np.concatenate([np.asarray(leaf).reshape(N, -1) for leaf in jax.tree.leaves(tree)],
                          axis=1)


# ------------------------------------------------------------------------------------------
# compressed means within their stated error
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fp32", "bf16", "fp8", "int8"])
def test_cast_mean_within_error(method, mesh2d):
    block = 64
    g = grads_tree()
    mean, _ = C.per_device_mean(method, mesh2d, ("dp", "fsdp"), block=block)(g, None)
    x = flat_n(g)                                     # [device, L]
    exact = x.mean(0)
    got = np.concatenate([np.asarray(leaf).reshape(-1) for leaf in jax.tree.leaves(mean)])
    err = np.abs(got - exact)
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    amax = np.abs(x).max(0)                           # elementwise max over devices
    if method == "fp32":
        np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-7)
        return
    if method == "bf16":           # two roundings, each <= 2^-8 relative
        assert rel < 1e-2
        assert np.all(err <= 2 * 2.0 ** -8 * amax * 1.01 + 1e-12)
        return
    lp = F.padded_size(x.shape[1], N, block)
    block_max = np.pad(amax, (0, lp - amax.size)).reshape(-1, block).max(1)   # per block
    bound = np.repeat(block_max, block)[:amax.size]
    if method == "int8":           # two roundings of half a step, step = block max / 127
        assert np.all(err <= bound / 127 * 1.001 + 1e-9), (err / bound).max()
        assert (err / bound).max() > 1 / 2000            # it does quantise
    else:                          # e4m3: 3 mantissa bits, 1/16 relative per rounding
        assert rel < 1 / 16
        assert np.all(err <= 2 / 16 * amax + 2 * 2.0 ** -9 * bound / 448 * 1.01 + 1e-9)


@pytest.mark.parametrize("method,wire,per_elem", [("bf16", "u16", 2), ("fp8", "u8", 1),
                                                  ("int8", "s8", 1), ("sign", "u8", 1 / 8)])
def test_payload_travels_in_low_precision(method, wire, per_elem, mesh1d):
    """Bytes per element type of the collectives in the compiled HLO: the payload in the wire
    type, fp32 only for the scales (one per block of 128), no all-reduce."""
    L, block = 64 * 64, 128
    g = rand((N, 64, 64))
    st = C.init_state(method, g[0], N, block=block)
    st = None if st is None else C.stack(st, N)
    text = C.per_device_mean(method, mesh1d, "dp", block=block).lower(g, st).compile().as_text()
    size = {"u16": 2, "u8": 1, "s8": 1, "f32": 4, "f16": 2, "bf16": 2, "f8e4m3fn": 1}
    by_type = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (all-to-all|all-gather|all-reduce)\(", line)
        if m:
            for t, dims in re.findall(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]", m.group(1)):
                n_el = math.prod(int(d) for d in dims.split(",") if d)
                by_type[t] = by_type.get(t, 0) + n_el * size[t]
    assert "all-reduce(" not in text
    scales = 0 if method == "bf16" else 2 * 4 * L // block          # all-to-all + all-gather
    assert by_type == ({wire: 2 * L * per_elem, "f32": scales} if scales else
                       {wire: 2 * L * per_elem}), by_type


def test_sign_state_and_topk_value_dtype(mesh1d):
    g = {"a": rand((N, 33, 8), 3)}
    st = C.stack(C.init_state("sign", g["a"][0], N, block=64), N)
    mean, st2 = C.per_device_mean("sign", mesh1d, "dp", block=64)(g["a"], st)
    assert mean.shape == (33, 8) and st2[1].shape == (N, F.padded_size(264, N, 64) // N)
    # the residual is what was not sent: g - decode(encode(g)) is nonzero and smaller than g
    assert 0 < float(jnp.abs(st2[0]).mean()) < float(jnp.abs(g["a"]).mean())
    res = C.stack(C.init_state("topk", {"a": g["a"][0]}, N), N)
    m16, r16 = C.per_device_mean("topk", mesh1d, "dp", k=20, value_dtype=jnp.bfloat16)(g, res)
    m32, r32 = C.per_device_mean("topk", mesh1d, "dp", k=20)(g, res)
    np.testing.assert_allclose(np.asarray(m16["a"]), np.asarray(m32["a"]), rtol=1e-2, atol=1e-2)
    # residual + sent = gradient, per device
    assert int((np.asarray(r32["a"]).reshape(N, -1) == 0).sum(1).min()) == 20


# ------------------------------------------------------------------------------------------
# error feedback on a quadratic: 8 workers, different targets
# ------------------------------------------------------------------------------------------
def train_quadratic(mesh, method, shape=(16, 16), lr=0.01, steps=600, ef=True, **params):
    """min_w mean_d sum((w - t_d)^2) by SGD on the compressed mean; excess loss |w - tbar|^2."""
    t = rand((N,) + shape, seed=1)
    st = C.init_state(method, t[0], N, error_feedback=ef, **params)
    st = None if st is None else C.stack(st, N)
    specs = None if st is None else C.state_specs(st, "dp")

    def body(t, s):
        t, s = t[0], (None if s is None else jax.tree.map(lambda a: a[0], s))
        tbar = jax.lax.psum(t, "dp") / N

        def step(carry, _):
            w, s = carry
            mean, s = C.compressed_mean(method, 2 * (w - t), s, "dp", **params)
            w = w - lr * mean
            return (w, s), jnp.sum((w - tbar) ** 2)
        return jax.lax.scan(step, (jnp.zeros(shape), s), None, length=steps)[1]
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), specs), out_specs=P()))
    return np.asarray(fn(t, st))


def test_error_feedback_converges_where_plain_topk_stalls(mesh1d):
    k = 16                                          # 1/16 of the 256 coordinates
    exact = train_quadratic(mesh1d, "fp32")
    ef = train_quadratic(mesh1d, "topk", k=k)
    plain = train_quadratic(mesh1d, "topk", k=k, ef=False)
    start = plain[0]
    assert exact[-1] < 1e-8 * start
    # without feedback, each worker's top-k is biased towards its own target: it stalls
    assert plain[-1] > 0.5 * start and abs(plain[-1] - plain[300]) < 0.05 * start
    # with feedback: within a floor ~ lr^2 (classic EF, heterogeneous workers), far below
    assert ef[-1] < 0.01 * start and ef[-1] < plain[-1] / 50


@pytest.mark.parametrize("method,params", [("threshold", {"threshold": 0.05, "k": 64}),
                                           ("sign", {"block": 64}),
                                           ("powersgd", {"rank": 2})])
def test_error_feedback_methods_converge(method, params, mesh1d):
    losses = train_quadratic(mesh1d, method, **params)
    assert losses[-1] < 0.01 * losses[0], (losses[0], losses[-1])


# ------------------------------------------------------------------------------------------
# PowerSGD
# ------------------------------------------------------------------------------------------
def test_powersgd_reproduces_low_rank_mean(mesh1d):
    r, n, m = 3, 24, 20
    u, v = rand((n, r), 5), rand((m, r), 6)
    a = rand((N, r, r), 7)                          # device d: U A_d V^T, mean of rank r
    g = {"w": jnp.einsum("nr,drs,ms->dnm", u, a, v), "b": rand((N, 7), 8)}
    st = C.stack(C.init_state("powersgd", jax.tree.map(lambda x: x[0], g), N, rank=r), N)
    mean, st2 = C.per_device_mean("powersgd", mesh1d, "dp", rank=r)(g, st)
    exact = jax.tree.map(lambda x: x.mean(0), g)
    np.testing.assert_allclose(np.asarray(mean["w"]), np.asarray(exact["w"]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(mean["b"]), np.asarray(exact["b"]), atol=1e-6)
    assert st2.q["w"].shape == (N, m, r) and st2.q["b"].shape == (N, 1)
    np.testing.assert_allclose(np.asarray(st2.q["w"][0]), np.asarray(st2.q["w"][5]))
    # the residual is each device's part outside the shared rank-r space: M_d - P P^T mean
    full = C.per_device_mean("powersgd", mesh1d, "dp", rank=1)
    st1 = C.stack(C.init_state("powersgd", jax.tree.map(lambda x: x[0], g), N, rank=1), N)
    m1, _ = full(g, st1)
    err1 = float(jnp.linalg.norm(m1["w"] - exact["w"]) / jnp.linalg.norm(exact["w"]))
    assert err1 > 1e-2                              # rank 1 < 3 does lose something


# ------------------------------------------------------------------------------------------
# census bytes = the formulas
# ------------------------------------------------------------------------------------------
CENSUS_CASES = [("fp32", {}), ("bf16", {}), ("fp8", {"block": 128}), ("int8", {"block": 128}),
                ("int8", {"block": 100}), ("sign", {"block": 128}), ("topk", {"k": 100}),
                ("threshold", {"k": 100, "threshold": 0.1}), ("powersgd", {"rank": 4})]


@pytest.mark.parametrize("method,params", CENSUS_CASES)
def test_census_equals_wire_bytes(method, params, mesh2d):
    shapes = [(64, 96), (1024,)]      # 7168 = 7 x 1024 elements: no padding at block 128
    axes = ("dp", "fsdp")
    g = {"w": rand((N, 64, 96)), "b": rand((N, 1024), 1)}
    st = C.init_state(method, jax.tree.map(lambda x: x[0], g), N, **params)
    st = None if st is None else C.stack(st, N)
    fn = C.per_device_mean(method, mesh2d, axes, **params)
    rows = inspect.census(fn.lower(g, st).compile().as_text(), mesh2d)
    want = F.collectives(method, shapes, N, axes=axes, **params)
    by_kind = lambda rs, get: {k: sum(get(r) for r in rs if (r["kind"] if isinstance(r, dict)
                                                            else r.kind) == k)
                               for k in {(r["kind"] if isinstance(r, dict) else r.kind)
                                         for r in rs}}
    assert by_kind(rows, lambda r: r["bytes"]) == by_kind(want, lambda c: c.bytes)
    assert all(r["axes"] == list(axes) for r in rows)
    assert sum(r["wire_bytes"] for r in rows) == F.wire_bytes(method, shapes, N, axes=axes,
                                                              **params)
    L, fp32 = 64 * 96 + 1024, F.wire_bytes("fp32", shapes, N)
    assert fp32 == 2 * (N - 1) / N * 4 * L
    if method == "int8" and params["block"] == 128:   # 1/4 of fp32 + one fp32 scale per 128
        assert F.wire_bytes(method, shapes, N, **params) == fp32 / 4 * (1 + 4 / 128)
        assert F.payload_bytes(method, shapes, N, **params) == L + 4 * L // 128
    if method in ("topk", "threshold"):    # k x (int32 index + fp32 value) per device
        assert F.payload_bytes(method, shapes, N, **params) == 100 * (4 + 4)
        assert sum(r["bytes"] for r in rows) == N * 100 * 8
    if method == "powersgd":   # (n + m) r 4, the vector uncompressed
        assert F.payload_bytes(method, shapes, N, **params) == (64 + 96) * 4 * 4 + 1024 * 4


def test_wire_bytes_formulas():
    n, L = 8, 1 << 20
    fp32 = F.wire_bytes("fp32", (L,), n)
    assert F.wire_bytes("bf16", (L,), n) == fp32 / 2
    assert F.wire_bytes("sign", (L,), n, block=256) == fp32 * (1 / 32 + 1 / 256)
    assert F.wire_bytes("topk", (L,), n, k=1000, value_dtype=jnp.bfloat16) == 7 * 1000 * 6
    assert F.payload_bytes("powersgd", (1024, 512), n, rank=8) == (1024 + 512) * 8 * 4
    # padding: 10 elements, 8 devices x block 4 -> 32 elements and 8 scales on the wire
    assert F.payload_bytes("int8", (10,), n, block=4) == 32 + 8 * 4
    assert F.wire_bytes("powersgd", [(4, 64, 32)], n, rank=2) == 2 * 7 / 8 * 4 * (64 + 32) * 2 * 4


# ------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------
def test_bad_inputs(mesh1d):
    g = rand((N, 10, 6))
    with pytest.raises(ValueError, match="data axes"):
        C.per_device_mean("int8", mesh1d, ())
    with pytest.raises(ValueError, match="data axes"):
        F.collectives("int8", (10,), N, axes=None)
    for k in (0, 61):
        with pytest.raises(ValueError, match=r"k must be an int in \[1, 60\]"):
            C.per_device_mean("topk", mesh1d, "dp", k=k)(g, None)
        with pytest.raises(ValueError, match="k must be"):
            F.wire_bytes("topk", (10, 6), N, k=k)
    with pytest.raises(ValueError, match=r"rank=7 exceeds the matrix dimension.*<= 5"):
        C.init_state("powersgd", g[0], N, rank=7)
    with pytest.raises(ValueError, match="exceeds the matrix dimension"):
        F.wire_bytes("powersgd", (10, 6), N, rank=7)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        powersgd.init(g[0], 0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="does not divide.*pad=True"):
        C.per_device_mean("int8", mesh1d, "dp", block=7, pad=False)(g, None)
    with pytest.raises(ValueError, match="does not divide"):
        F.wire_bytes("int8", (10, 6), N, block=7, pad=False)
    with pytest.raises(ValueError, match="multiple of 8"):
        C.init_state("sign", g[0], N, block=12)
    with pytest.raises(ValueError, match="block must be a positive int"):
        C.per_device_mean("fp8", mesh1d, "dp", block=0)(g, None)
    with pytest.raises(ValueError, match="dtype must be one of"):
        C.allreduce_cast(g[0], "dp", jnp.float16)
    with pytest.raises(ValueError, match="unknown compression method"):
        F.wire_bytes("gzip", (10,), N)
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        C.allreduce_cast(g[0], "dp", jnp.int8)
    with pytest.raises(ValueError, match="threshold must be a number"):
        C.per_device_mean("threshold", mesh1d, "dp", k=5, threshold=-1.0)(g, None)
    # a state built for another device count / rank is refused, not silently misused
    st = C.stack(C.init_state("sign", g[0], 4, block=8), N)
    with pytest.raises(ValueError, match="rebuild it with init_state"):
        C.per_device_mean("sign", mesh1d, "dp", block=8)(g, st)
    st = C.stack(C.init_state("powersgd", g[0], N, rank=2), N)
    with pytest.raises(ValueError, match="rebuild the state"):
        C.per_device_mean("powersgd", mesh1d, "dp", rank=3)(g, st)


# ----------------------------------------------------------------------------- in the train step
DP8 = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1")


@pytest.fixture(scope="module")
def one_device():
    return numerics.one_device()


@pytest.mark.parametrize("method", ["int8", "powersgd"])
def test_plan_compression_tracks_one_device_and_its_census_is_the_formula(method, one_device):
    from jaxscale import plan
    extra = ("plan.compression_rank=2",) if method == "powersgd" else ()
    got = numerics.run((*DP8, f"plan.compression={method}", *extra))
    numerics.assert_matches(got, one_device, numerics.COMPRESSION[method])
    s = got.setup
    census = inspect.census(s.lower_train_step().compile().as_text(), s.placement.mesh)
    if method == "powersgd":
        state = s.init_state()
        q = jax.tree.leaves(state.comm.q)[0]
        assert q.shape[0] == 8 and q.sharding.spec[0] == MESH_AXES  # a slice per device
        # by hand from the parameters' shapes: each leaf a batch of matrices over its last two
        # dimensions, P [n, r] and Q [m, r] in fp32 summed over dp; a leaf whose last two
        # dimensions are not both above the rank goes whole; and the loss and token count
        def psgd(shape, r=2):
            *batch, n, m = shape if len(shape) > 1 else (1, *shape)
            return math.prod(batch) * (n + m) * r * 4 if min(n, m) > r else 4 * math.prod(shape)
        want = 8 + sum(psgd(p.shape) for p in jax.tree.leaves(s.abstract_state().params))
        assert census == [{**census[0], "kind": "all-reduce", "axes": ["dp"], "bytes": want}]
        return
    theory = inspect.theory_vs_census(plan.collectives(s.placement.spec), census)
    for r in theory:        # the method's all-to-alls and all-gathers; the scalar token count
        assert r["census_bytes"] == r["theory_bytes"] or (r["census_bytes"] == 0
                                                          and r["theory_bytes"] == 4), r
    assert {r["kind"] for r in theory} == {"all-to-all", "all-gather", "all-reduce"}


@pytest.mark.parametrize("overrides, message", [
    (("mesh.dp=1", "mesh.fsdp=8", "mesh.tp=1"),
     "compresses the gradient mean over mesh.dp, but mesh.dp=1"),
    (("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", "plan.compression_rank=500"),
     "leaves no gradient matrix to compress"),
])
def test_plans_compression_cannot_run_are_refused(overrides, message):
    from jaxscale import plan
    from jaxscale.analysis.validation import tiny_config
    method = "powersgd" if "rank" in message or any("rank" in o for o in overrides) else "int8"
    with pytest.raises(ValueError, match=message):
        plan.validate(tiny_config(*overrides, f"plan.compression={method}"), 8)
