"""Context-parallel attention (ring, Ulysses, all-gather over `sp`) against one device.

Each (case, method) is compiled once, as a jitted forward+backward over inputs already in the
case's sequence layout and sharded as the wrapper shards them; that one program gives both the
numerics (o, dq, dk, dv against `reference_attention`, fp32, 1e-5) and the collective census
(against `collective_counts`, read from the compiled HLO by `jaxscale.analysis.inspect.census`).
Shapes are tiny (T <= 64, D = 8) so the file runs in well under a minute on 2 CPU cores.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.analysis.inspect import census
from jaxscale.axes import Rules, use_rules
from jaxscale.kernels.reference import reference_attention
from jaxscale.mesh import MeshConfig, make_mesh
from jaxscale.strategies.sp.context import collective_counts, context_attention
from jaxscale.strategies.sp.heads import ulysses_slots
from jaxscale.strategies.sp.seq_layout import (
    from_layout,
    hop_pairs,
    layout_permutation,
    layout_positions,
    ring_work,
    to_layout,
    zigzag_permutation,
)

D = 8
ALL = ("ring", "ulysses", "allgather")
# name: (mesh degrees, B, T, H, K, causal, segments, layout, implementation, methods)
# Ulysses pads where sp does not divide the heads (`sp/heads.py`): the MQA cases send the one kv
# head to every shard, the 3-head case a zero head and kv heads twice. Lengths: 36/2 and
# 40/4 and 48/8 give zig-zag chunks of 9, 5 and 3 rows (not multiples of the blockwise tile 8);
# 18 is not divisible by 2*sp = 4, so that case runs contiguous.
CASES = {
    "sp2-gqa-causal-seg-odd": (dict(sp=2), 2, 36, 4, 2, True, True, "zigzag", "blockwise", ALL),
    "sp2-mqa-causal-contig": (dict(sp=2), 2, 18, 4, 1, True, False, "contiguous", "xla", ALL),
    "sp4-gqa-causal-seg-odd": (dict(sp=4), 2, 40, 8, 4, True, True, "zigzag", "xla", ALL),
    "sp4-mqa-full-seg": (dict(sp=4), 1, 32, 4, 1, False, True, "zigzag", "blockwise", ALL),
    "sp8-gqa-causal-odd": (dict(sp=8), 1, 48, 16, 8, True, False, "zigzag", "xla", ALL),
    "sp8-gqa-causal-seg-contig": (dict(sp=8), 1, 64, 4, 2, True, True, "contiguous", "blockwise",
                                  ("ring",)),
    "sp8-full-seg": (dict(sp=8), 1, 48, 8, 8, False, True, "zigzag", "xla", ("ulysses",)),
    "dp2xsp4-batch-over-dp": (dict(dp=2, sp=4), 2, 32, 8, 4, True, True, "zigzag", "xla",
                              ("ring", "ulysses")),
    "sp2xtp2-heads-over-tp": (dict(sp=2, tp=2), 1, 32, 8, 4, True, True, "zigzag", "xla", ALL),
    "sp2-pallas": (dict(sp=2), 1, 32, 4, 2, True, True, "zigzag", "pallas", ("ring",)),
    "sp2xtp2-3-heads-per-rank": (dict(sp=2, tp=2), 1, 32, 6, 2, True, True, "zigzag", "blockwise",
                                 ("ulysses",)),
}
PARAMS = [pytest.param(name, m, id=f"{name}-{m}") for name, c in CASES.items() for m in c[-1]]


def _mesh(degrees):
    n = int(np.prod(list(degrees.values())))
    return make_mesh(MeshConfig(**degrees), devices=jax.devices()[:n])


@functools.lru_cache(maxsize=None)
def _case(name):
    """Inputs in true order and the reference's o, dq, dk, dv (numpy), computed once per case."""
    _, B, T, H, K, causal, segments, *_ = CASES[name]
    rng = np.random.default_rng(len(name))
    q, do = (rng.standard_normal((B, T, H, D), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, T, K, D), np.float32) for _ in range(2))
    seg = None
    if segments:  # packed documents: a few boundaries per row
        seg = np.cumsum(rng.random((B, T)) < 0.12, axis=1).astype(np.int32)

    @jax.jit
    def ref(q, k, v, do, seg):
        o, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=causal,
                                                             segment_ids=seg), q, k, v)
        return (o, *vjp(do))
    return (q, k, v, do, seg), tuple(np.asarray(x) for x in ref(q, k, v, do, seg))


def _sharded_run(name, method):
    """(o, dq, dk, dv) in true order, and the compiled program's census rows."""
    degrees, B, T, H, K, causal, segments, layout, impl, _ = CASES[name]
    mesh = _mesh(degrees)
    sp = degrees["sp"]
    (q, k, v, do, seg), _ = _case(name)
    to = lambda x: None if x is None else to_layout(x, sp, 1, layout)  # noqa: E731  data side
    batch = "dp" if "dp" in degrees else None
    heads = "tp" if "tp" in degrees else None
    x_sh = NamedSharding(mesh, P(batch, "sp", heads, None))
    put = lambda x, sh=x_sh: None if x is None else jax.device_put(to(x), sh)  # noqa: E731
    args = (put(q), put(k), put(v), put(do), put(seg, NamedSharding(mesh, P(batch, "sp"))))
    kw = dict(method=method, causal=causal, layout=layout, implementation=impl,
              block_q=8, block_k=8)
    if heads:   # the model's way: logical rules active, no mesh passed
        rules = Rules().add("batch", (), by="test").add("seq", "sp", by="sp")
        rules.add("heads", "tp", by="tp").add("kv_heads", "tp", by="tp")
        call = lambda q, k, v, s: _under(mesh, rules, q, k, v, s, kw)  # noqa: E731
    else:
        call = lambda q, k, v, s: context_attention(  # noqa: E731
            q, k, v, mesh=mesh, batch_axes=batch, segment_ids=s, **kw)

    def fwd_bwd(q, k, v, do, seg):
        o, vjp = jax.vjp(lambda q, k, v: call(q, k, v, seg), q, k, v)
        return (o, *vjp(do))
    compiled = jax.jit(fwd_bwd).lower(*args).compile()
    outs = compiled(*args)
    back = tuple(from_layout(np.asarray(x), sp, 1, layout) for x in outs)
    return back, census(compiled.as_text(), mesh)


def _under(mesh, rules, q, k, v, seg, kw):
    with use_rules(mesh, rules):
        return context_attention(q, k, v, segment_ids=seg, **kw)


def _counts(rows):
    assert all(r["axes"] == ["sp"] for r in rows), rows   # nothing over dp / tp
    return {r["kind"]: r["count"] for r in rows}


@pytest.mark.parametrize("name,method", PARAMS)
def test_equals_full_attention_and_census(name, method):
    got, rows = _sharded_run(name, method)
    _, want = _case(name)
    for label, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=f"{method} {label}")
    degrees, segments = CASES[name][0], CASES[name][6]
    expect = collective_counts(method, degrees["sp"], segment_ids=segments)
    total = dict(expect["forward"])
    for kind, n in expect["backward"].items():
        total[kind] = total.get(kind, 0) + n
    assert _counts(rows) == total


@pytest.mark.parametrize("method", ALL)
def test_forward_census_and_bytes(method):
    """Forward only, sp=4: the stated forward counts, and the K/V bytes each method moves."""
    sp, B, T, H, K = 4, 1, 32, 4, 4
    mesh = _mesh(dict(sp=sp))
    sh = NamedSharding(mesh, P(None, "sp", None, None))
    q = jax.device_put(jnp.ones((B, T, H, D)), sh)
    kv = jax.device_put(jnp.ones((B, T, K, D)), sh)
    seg = jax.device_put(jnp.zeros((B, T), jnp.int32), NamedSharding(mesh, P(None, "sp")))
    f = jax.jit(lambda q, k, v, s: context_attention(q, k, v, mesh=mesh, method=method,
                                                     segment_ids=s))
    rows = census(f.lower(q, kv, kv, seg).compile().as_text(), mesh)
    assert _counts(rows) == collective_counts(method, sp, segment_ids=True)["forward"]
    nbytes = {r["kind"]: r["bytes"] for r in rows}
    block = 2 * B * (T // sp) * K * D * 4                    # the local K and V, fp32
    if method == "ring":
        assert nbytes["collective-permute"] == (sp - 1) * block
    elif method == "allgather":
        assert nbytes["all-gather"] == sp * block + B * T * 4    # K/V gathered + the segment ids
    else:
        assert nbytes["all-to-all"] == B * (T // sp) * (2 * H + 2 * K) * D * 4


@pytest.mark.parametrize("H, K, sp, q_slots, kv_slots", [
    # 3 q heads, 1 kv head over 2 shards: q (0, 1 | 2, zero), the kv head to both shards
    (3, 1, 2, ((0, 1), (2, -1)), ((0,), (0,))),
    # 6 q heads in 2 groups of 3 over 4 shards: shard 1's q heads 2, 3 read kv heads 0 and 1, so
    # every shard takes one kv slot per q slot; shard 3 takes zero heads only
    (6, 2, 4, ((0, 1), (2, 3), (4, 5), (-1, -1)), ((0, 0), (0, 1), (1, 1), (-1, -1))),
    # 8 q heads, 4 kv heads over 8 shards: one q head each, each kv head to two shards
    (8, 4, 8, tuple((h,) for h in range(8)), tuple((h // 2,) for h in range(8))),
    # divisible: no padding, the heads in order (4 q heads and 2 kv heads a shard)
    (8, 4, 2, ((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 1), (2, 3))),
])
def test_ulysses_slots_pad_the_heads_sp_does_not_divide(H, K, sp, q_slots, kv_slots):
    s = ulysses_slots(H, K, sp)
    assert (s.q, s.kv) == (q_slots, kv_slots)
    assert s.padded == (H % sp > 0 or K % sp > 0)
    # every real q head reads its own kv head (group H / K) from its shard's kv slot
    for qs, ks in zip(s.q, s.kv):
        for j, h in enumerate(qs):
            assert h < 0 or ks[j // (s.nq // s.nk)] == h // (H // K)


def test_ulysses_moves_the_padded_slots():
    """Forward only, sp=4, 6 q and 2 kv heads: each all-to-all carries 2 q or 2 kv slots per
    shard (8 of each per token, against 6 and 2 heads), and the output matches one device."""
    sp, B, T, H, K = 4, 1, 32, 6, 2
    mesh = _mesh(dict(sp=sp))
    sh = NamedSharding(mesh, P(None, "sp", None, None))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, n, D), np.float32) for n in (H, K, K))
    f = jax.jit(lambda q, k, v: context_attention(q, k, v, mesh=mesh, method="ulysses",
                                                  layout="contiguous"))
    args = [jax.device_put(x, sh) for x in (q, k, v)]
    compiled = f.lower(*args).compile()
    rows = census(compiled.as_text(), mesh)
    assert _counts(rows) == {"all-to-all": 4}
    assert rows[0]["bytes"] == B * (T // sp) * (2 * 8 + 2 * 8) * D * 4
    want = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(compiled(*args)), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- layouts
def test_zigzag_layout():
    assert layout_positions(8, 2).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert layout_positions(8, 2, "contiguous").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    perm = zigzag_permutation(48, 4)
    assert sorted(perm.tolist()) == list(range(48))
    x = np.arange(2 * 48).reshape(2, 48)
    assert (to_layout(x, 4) == x[:, perm]).all()
    assert (from_layout(to_layout(x, 4), 4) == x).all()
    y = jnp.asarray(x, jnp.float32)[..., None]
    assert np.array_equal(from_layout(to_layout(y, 4, 1), 4, 1), y)
    assert (layout_permutation(12, 3, "contiguous") == np.arange(12)).all()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_hop_pairs_cover_exactly_the_allowed_scores(layout, causal):
    """For every (shard, visiting shard), the pair a hop computes holds every allowed (query, key)
    of the true-position mask, and nothing allowed lies outside it (skipped work is all masked)."""
    sp, T = 4, 32
    pos = layout_positions(T, sp, layout)
    Tl = T // sp
    own, before, after = hop_pairs(Tl, layout, causal)
    for r in range(sp):
        for src in range(sp):
            allowed = (pos[r][:, None] >= pos[src][None, :]) if causal else np.ones((Tl, Tl), bool)
            pair = own if src == r else before if src < r else after
            computed = np.zeros((Tl, Tl), bool)
            if pair is not None:
                block = np.ones((pair.q1 - pair.q0, pair.k1 - pair.k0), bool)
                if pair.causal:
                    block = np.tril(block)
                computed[pair.q0:pair.q1, pair.k0:pair.k1] = block
            assert (computed == allowed).all(), (layout, r, src)


def test_zigzag_balances_causal_work():
    sp, T = 4, 256
    zig = ring_work(T, sp, layout="zigzag", block_q=16, block_k=16)
    contig = ring_work(T, sp, layout="contiguous", block_q=16, block_k=16)
    assert max(zig) == min(zig)                     # every shard visits the same tiles
    assert contig == sorted(contig) and contig[-1] > 3 * contig[0]   # shard sp-1 waits on the rest
    assert sum(zig) == sum(contig)                  # same total work, only spread differently
    assert max(zig) < 0.6 * max(contig)             # the step (slowest shard) gets faster
    full = ring_work(T, sp, causal=False, block_q=16, block_k=16)
    assert full == [(T // sp // 16) ** 2 * sp] * sp


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_numbers():
    mesh = _mesh(dict(sp=2))
    q, kv1 = jnp.zeros((1, 16, 4, D)), jnp.zeros((1, 16, 1, D))
    q18, kv18 = jnp.zeros((1, 18, 4, D)), jnp.zeros((1, 18, 2, D))
    with pytest.raises(ValueError, match=r"length 18 is not divisible by 4.*contiguous"):
        context_attention(q18, kv18, kv18, mesh=mesh, method="ring")
    with pytest.raises(ValueError, match="unknown context-parallel method 'tree'"):
        context_attention(q, kv1, kv1, mesh=mesh, method="tree")
    with pytest.raises(ValueError, match="cuDNN.*log-sum-exp"):
        context_attention(q, kv1, kv1, mesh=mesh, method="ring", implementation="cudnn")
    rules = Rules().add("seq", "tp", by="test")
    with pytest.raises(ValueError, match="rules map logical 'seq' to 'tp'"):
        context_attention(q, kv1, kv1, mesh=mesh, rules=rules)
