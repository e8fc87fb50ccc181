"""Attention implementations against the reference: forward, dq/dk/dv, masks, memory, model step.

Pallas kernels run in interpret mode here (CPU); their Triton lowering is checked by lowering for
the `cuda` platform, which needs no GPU. Sizes are small so the file runs in about two minutes.
"""
import dataclasses
import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxscale.hooks.attention import AUTO_XLA_MAX_SCORES, IMPLEMENTATIONS, attention, resolve
from jaxscale.kernels.blockwise import (
    blockwise_attention,
    finalize,
    init_carry,
    online_softmax_step,
)
from jaxscale.kernels.flash_attention import BlockSizes, flash_attention, visited_tiles
from jaxscale.kernels.reference import reference_attention
from jaxscale.kernels.tiles import BlockSparseMask, tile_map, tile_mask

SMALL_BLOCKS = BlockSizes(16, 32, 16, 32, 32, 16)   # several tiles even for short sequences


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_inputs(B, T, S, H, K, D, dtype=jnp.float32, seed=0, segments=False):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, S, K, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, S, K, D), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, T, H, D), jnp.float32).astype(dtype)
    seg = None
    if segments:  # packed: 2-4 documents per row at random boundaries
        seg = jnp.cumsum(jax.random.bernoulli(ks[4], 0.08, (B, T)), axis=1).astype(jnp.int32)
    return q, k, v, do, seg


def kernel_fn(impl, **kw):
    if impl == "blockwise":
        return functools.partial(blockwise_attention, block_q=16, block_k=16, **kw)
    return functools.partial(flash_attention, block_sizes=SMALL_BLOCKS, **kw)


@functools.partial(jax.jit, static_argnums=(0,))
def fwd_bwd(f, q, k, v, do):
    o, vjp = jax.vjp(f, q, k, v)
    return (o, *vjp(do))


def check_against_reference(impls, B, T, H, K, D, *, causal, window=None, block_mask=None,
                            segments=False, dtype=jnp.float32, tol=1e-5, seed=0):
    q, k, v, do, seg = make_inputs(B, T, T, H, K, D, dtype, seed, segments)
    dense = None if block_mask is None else jnp.asarray(block_mask.dense(T, T))
    ref = functools.partial(reference_attention, causal=causal, window=window, segment_ids=seg,
                            mask=dense)
    # the reference in fp32 from the same (rounded) inputs is the ground truth for every dtype
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    expected = fwd_bwd(ref, *f32)
    for impl in impls:
        f = kernel_fn(impl, causal=causal, window=window, segment_ids=seg, block_mask=block_mask)
        got = fwd_bwd(f, q, k, v, do)
        for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
            assert g.dtype == dtype, (impl, name, g.dtype)
            assert np.all(np.isfinite(np.asarray(g, np.float32))), (impl, name)
            err = rel_err(g, e)
            assert err < tol, f"{impl} {name}: relative error {err:.2e} >= {tol}"


CASES = [  # B, T, H, K, D, causal, window, segments
    pytest.param(2, 37, 4, 2, 16, True, None, False, id="gqa2-causal-odd37"),
    pytest.param(1, 64, 4, 1, 16, False, 8, False, id="mqa-window8-noncausal"),
    pytest.param(2, 50, 4, 4, 8, True, None, True, id="mha-packed-segments-d8"),
    pytest.param(1, 45, 8, 2, 24, True, 20, False, id="gqa4-causal-window-d24-odd45"),
]


@pytest.mark.parametrize("B,T,H,K,D,causal,window,segments", CASES)
def test_fp32_matches_reference(B, T, H, K, D, causal, window, segments):
    check_against_reference(("blockwise", "pallas"), B, T, H, K, D, causal=causal, window=window,
                            segments=segments)


def test_block_sparse_matches_reference():
    bm = BlockSparseMask.local(4, 4, width=2, block_q=16, block_k=16, global_blocks=1)
    check_against_reference(("blockwise", "pallas"), 1, 64, 4, 2, 16, causal=True, block_mask=bm)


@given(T=st.integers(5, 70), ratio=st.sampled_from([1, 2, 4]), causal=st.booleans(),
       window=st.sampled_from([None, 3, 17]), segments=st.booleans(), seed=st.integers(0, 99))
@settings(max_examples=3, deadline=None)
def test_blockwise_random_shapes(T, ratio, causal, window, segments, seed):
    check_against_reference(("blockwise",), 1, T, 2 * ratio, 2, 16, causal=causal, window=window,
                            segments=segments, seed=seed)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_matches_reference(dtype):
    impls = ("blockwise", "pallas") if dtype == jnp.bfloat16 else ("pallas",)
    check_against_reference(impls, 1, 48, 4, 2, 32, causal=True, segments=True, dtype=dtype,
                            tol=2e-2)


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_fully_masked_rows_give_zeros_not_nan(impl):
    B, T, S, H, K, D = 1, 24, 32, 2, 1, 16
    q, k, v, do, _ = make_inputs(B, T, S, H, K, D)
    qseg = jnp.asarray([[0] * 8 + [1] * 8 + [7] * 8], jnp.int32)      # id 7 has no key
    kseg = jnp.asarray([[0] * 16 + [1] * 16], jnp.int32)
    bm = BlockSparseMask.from_array([[1, 1], [0, 0], [1, 0]], 8 if impl == "blockwise" else 16, 16)
    for kw in (dict(kv_segment_ids=kseg, segment_ids=qseg), dict(block_mask=bm)):
        f = kernel_fn(impl, causal=False, **kw)
        o, dq, dk, dv = fwd_bwd(f, q, k, v, do)
        assert all(np.all(np.isfinite(x)) for x in (o, dq, dk, dv))
        dead = (np.asarray(qseg[0]) == 7) if "segment_ids" in kw else \
            np.asarray(bm.dense(T, S)).sum(1) == 0
        assert dead.any()
        np.testing.assert_array_equal(np.asarray(o)[0, dead], 0.0)
        np.testing.assert_array_equal(np.asarray(dq)[0, dead], 0.0)
        mask = (qseg[0][:, None] == kseg[0][None, :]) if "segment_ids" in kw else bm.dense(T, S)
        ref = functools.partial(reference_attention, causal=False, mask=jnp.asarray(mask)[None])
        for g, e in zip((o, dq, dk, dv), fwd_bwd(ref, q, k, v, do)):
            assert rel_err(g, e) < 1e-5


def test_tile_map_skips_masked_tiles():
    causal = tile_map(256, 256, 32, 32, causal=True)
    assert (causal.visited, causal.full, causal.dense) == (36, 28, 64)   # 8 diagonal tiles masked
    win = tile_map(256, 256, 32, 32, causal=True, window=32)
    assert win.visited == 15 and win.full == 0
    bm = BlockSparseMask.local(4, 4, width=1, block_q=64, block_k=64)     # diagonal only
    sparse = tile_map(256, 256, 32, 32, causal=False, block_mask=bm)
    assert sparse.visited == 16 == sparse.full
    assert sorted(sparse.kv_index[5, :2].tolist()) == [4, 5]
    assert visited_tiles(4096, 4096, causal=True)["visited"] < 0.52 * (32 * 64)
    with pytest.raises(ValueError, match="must divide"):
        tile_map(256, 256, 32, 32, causal=False,
                 block_mask=BlockSparseMask.local(4, 4, 1, 48, 48))


@given(T=st.integers(1, 90), S=st.integers(1, 90), bq=st.sampled_from([8, 16, 32]),
       bk=st.sampled_from([8, 16, 32]), causal=st.booleans(), window=st.one_of(
           st.none(), st.integers(1, 40)), q_offset=st.integers(0, 20),
       sparse_seed=st.integers(0, 3))
@example(T=64, S=64, bq=16, bk=16, causal=True, window=2, q_offset=0, sparse_seed=0)
@example(T=50, S=70, bq=16, bk=32, causal=False, window=3, q_offset=5, sparse_seed=0)
@settings(max_examples=150, deadline=None)
def test_tile_map_equals_brute_force(T, S, bq, bk, causal, window, q_offset, sparse_seed):
    """Visited tiles are exactly those holding an allowed pair; full tiles need no element mask."""
    bm = None
    if sparse_seed:
        rng = np.random.default_rng(sparse_seed)
        bm = BlockSparseMask.from_array(rng.random((-(-T // 32), -(-S // 32))) < 0.6, 32, 32)
    sch = tile_map(T, S, bq, bk, causal=causal, window=window, q_offset=q_offset,
                   block_mask=bm)
    nq, nk = -(-T // bq), -(-S // bk)
    dense = np.zeros((nq * bq, nk * bk), bool)
    d = np.arange(T)[:, None] + q_offset - np.arange(S)[None, :]   # reference_attention's rule
    dense[:T, :S] = (d >= 0 if causal else True) & (d < window if window else True)
    if bm is not None:
        dense[:T, :S] &= bm.dense(T, S)
    tiles = dense.reshape(nq, bq, nk, bk).transpose(0, 2, 1, 3)
    visited = np.zeros((nq, nk), bool)
    full = np.zeros((nq, nk), bool)
    for i in range(nq):
        idx = sch.kv_index[i, :sch.kv_count[i]]
        visited[i, idx] = True
        full[i, idx[:sch.kv_full[i]]] = True
    np.testing.assert_array_equal(visited, tiles.any((2, 3)))
    np.testing.assert_array_equal(full, tiles.all((2, 3)))
    assert sch.visited == visited.sum() and sch.full == full.sum()
    for j in range(nk):  # the transposed lists (dK/dV pass) hold the same tiles
        idx = sch.q_index[j, :sch.q_count[j]]
        np.testing.assert_array_equal(np.sort(idx), np.flatnonzero(visited[:, j]))


def test_online_softmax_step_composes_to_reference():
    """The ring-attention building blocks: fold two key halves, finalize == full attention."""
    q, k, v, _, _ = make_inputs(1, 16, 32, 4, 2, 16)
    carry = init_carry(q, 2)
    for half in (slice(0, 16), slice(16, 32)):
        pos = jnp.arange(32)[half]
        mask = tile_mask(jnp.arange(16) + 16, pos, causal=True)
        carry = online_softmax_step(q, k[:, half], v[:, half], carry, scale=16 ** -0.5, mask=mask)
    o, lse = finalize(carry)
    ref = reference_attention(jnp.pad(q, ((0, 0), (16, 0), (0, 0), (0, 0))), k, v)[:, 16:]
    assert rel_err(o, ref) < 1e-5 and lse.shape == (1, 4, 16)


def _temp_bytes(f, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    loss = lambda q, k, v: f(q, k, v).sum()  # noqa: E731
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_is_linear_xla_is_not():
    def temps(impl, T):
        f = (functools.partial(blockwise_attention, causal=True, block_q=64, block_k=64)
             if impl == "blockwise" else functools.partial(reference_attention, causal=True))
        return _temp_bytes(f, (1, T, 4, 64), (1, T, 2, 64), (1, T, 2, 64))
    b1, b2 = temps("blockwise", 512), temps("blockwise", 1024)
    assert b2 <= 2.2 * b1, (b1, b2)
    x1, x2 = temps("xla", 512), temps("xla", 1024)
    assert x2 >= 3.5 * x1 and x2 > 4 * b2, (x1, x2, b2)


def llama_step(impl, tokens, segment_ids):
    from jaxscale.models import Llama, get
    cfg = dataclasses.replace(get("tiny"), attention=impl)
    graphdef, params, rest = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1], segment_ids_BT=segment_ids)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    return jax.jit(jax.value_and_grad(loss_fn))(params)


def test_llama_training_step_matches_xla():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 41), 0, 320)
    seg = jnp.asarray([[0] * 25 + [1] * 15, [0] * 9 + [1] * 31], jnp.int32)   # packed rows
    loss_x, grads_x = llama_step("xla", tokens, seg)
    for impl in ("blockwise", "pallas"):
        loss, grads = llama_step(impl, tokens, seg)
        assert abs(float(loss) - float(loss_x)) < 1e-5 * abs(float(loss_x)), impl
        errs = jax.tree.leaves(jax.tree.map(rel_err, grads, grads_x))
        assert len(errs) > 5 and max(errs) < 1e-5, (impl, max(errs))


def test_dispatch_names_and_errors():
    assert IMPLEMENTATIONS == ("xla", "blockwise", "cudnn", "pallas")
    q, k, v, _, _ = make_inputs(1, 8, 8, 4, 2, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="cudnn' needs an NVIDIA GPU.*'blockwise'"):
        attention(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'; valid: xla, "
                                         "blockwise, cudnn, pallas, auto"):
        attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="query heads 4 must be a multiple of key/value heads 3"):
        attention(q, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3, 16)), implementation="blockwise")
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q, k, v, block_sizes=BlockSizes(block_q=24))
    with pytest.raises(ValueError, match="window must be >= 1"):
        attention(q, k, v, window=0, implementation="pallas")
    assert resolve("auto", q, k) == "xla"            # CPU, short: materialised scores are cheapest
    n = int(np.sqrt(AUTO_XLA_MAX_SCORES)) * 2
    big = jax.ShapeDtypeStruct((1, n, 4, 16), jnp.float32)
    assert resolve("auto", big, big) == "blockwise"


@pytest.mark.parametrize("dtype,D,T,H,K,kw", [
    (jnp.bfloat16, 128, 256, 8, 2, dict(causal=True, segments=True)),
    (jnp.float16, 64, 200, 4, 1, dict(causal=True, window=64)),
    (jnp.float32, 80, 130, 4, 4, dict(causal=False)),
])
def test_pallas_lowers_to_triton(dtype, D, T, H, K, kw):
    """Lower (not run) forward + backward for CUDA: exercises the Triton lowering rules on CPU."""
    segments = kw.pop("segments", False)
    seg = jax.ShapeDtypeStruct((1, T), jnp.int32) if segments else None

    def loss(q, k, v, seg):
        return flash_attention(q, k, v, segment_ids=seg, interpret=False, **kw).astype(
            jnp.float32).sum()
    args = (jax.ShapeDtypeStruct((1, T, H, D), dtype), jax.ShapeDtypeStruct((1, T, K, D), dtype),
            jax.ShapeDtypeStruct((1, T, K, D), dtype), seg)
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3    # forward, dq, dk/dv kernels


def test_gpu_bench_refuses_on_cpu_and_smoke_runs(tmp_path):
    import importlib.util
    import json
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "experiments" / "gpu_flash_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_flash_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit, match="not an NVIDIA GPU.*--allow-cpu"):
        bench.main(["--out", str(tmp_path)])
    bench.main(["--allow-cpu", "--out", str(tmp_path), "--seqs", "32", "--head-dims", "64",
                "--impls", "pallas,cudnn"])
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["device_kind"] and result["meta"]["date"]
    pallas = [r for r in result["rows"] if r["impl"] == "pallas"]
    assert len(pallas) == 2 and all(r["rel_err_vs_xla_fp32"] < 2e-2 for r in pallas)
    assert all("needs an NVIDIA GPU" in r["error"] for r in result["rows"] if r["impl"] == "cudnn")
    assert bench.attention_flops(1, 1024, 16, 128, causal=True, backward=True) == \
        4 * 1024 ** 2 * 128 * 16 * 0.5 * 3.5
    assert "| pallas |" in (tmp_path / "results.md").read_text()


def test_pallas_under_sharding_rules_runs_per_shard():
    """Under use_rules, pallas runs in shard_map over batch (dp) and heads (tp): results equal
    xla's and the compiled program gathers nothing (GSPMD alone would replicate the kernel)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxscale.axes import Rules, use_rules
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = Rules().add("batch", "dp", "test").add("heads", "tp", "test").add("kv_heads", "tp",
                                                                              "test")
    q, k, v, do, seg = make_inputs(4, 24, 24, 8, 4, 16, segments=True)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    q, do = put(q, P("dp", None, "tp")), put(do, P("dp", None, "tp"))
    k, v = put(k, P("dp", None, "tp")), put(v, P("dp", None, "tp"))
    seg = put(seg, P("dp"))

    def run(impl):
        def f(q, k, v):
            with use_rules(mesh, rules):
                return attention(q, k, v, segment_ids=seg, implementation=impl)
        step = jax.jit(lambda q, k, v, do: fwd_bwd(f, q, k, v, do))
        return step(q, k, v, do), step.lower(q, k, v, do).compile().as_text()
    (expected, _), (got, hlo) = run("xla"), run("pallas")
    assert "all-gather" not in hlo
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-5
