"""Compression library (`jaxscale.strategies.qat.ptq`): int8/int6/int4 weight-only PTQ of the tiny
model (logit error, exact bytes, per-element error bound), magnitude and 2:4 pruning masks (exact
counts, the right axis), the cubic sparsity schedule, the distillation loss (zero at T=1 for equal
logits, gradient vs finite differences), and errors naming the bad argument."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale.analysis.validation import tiny_config
from jaxscale.strategies.prune import masks as M
from jaxscale.strategies.qat import ptq as Q
from jaxscale.strategies.tables.params import contracted_axes, is_lookup
from jaxscale.train import distill
from jaxscale.train.state import FunctionalModel

#: max |logits_q - logits_fp32| / max |logits_fp32| of the tiny model (random init, 2 x 32
#: tokens); measured 0.0096 (int8), 0.042 (int6), 0.19 (int4): the tolerance has 2x margin
INT8_LOGIT_RTOL = 0.02


@pytest.fixture(scope="module")
def tiny():
    model = FunctionalModel(tiny_config().model)
    params = jax.jit(model.init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, model.cfg.vocab_size)
    return model, params, tokens


def _weights(model, params):
    """(path, names, array) of every leaf the rule calls a weight."""
    specs = jax.tree.leaves(model.logical, is_leaf=lambda x: isinstance(x, P))
    return [(jax.tree_util.keystr(p), tuple(s), w) for (p, w), s in
            zip(jax.tree_util.tree_leaves_with_path(params), specs)
            if contracted_axes(tuple(s)) is not None]


def test_contracted_axis_rule():
    assert contracted_axes(("layers", "embed", "heads", "head_dim")) == (1,)      # wq
    assert contracted_axes(("layers", "heads", "head_dim", "embed")) == (1, 2)    # wo
    assert contracted_axes(("layers", "mlp", "embed")) == (1,)                    # w_down
    assert contracted_axes(("layers", "embed", "mlp")) == (1,)                    # w_up
    assert contracted_axes(("embed", "vocab")) == (0,)                            # head
    assert contracted_axes(("vocab", "embed")) == (1,)          # lookup: one scale per row
    assert contracted_axes(("experts", "mlp", "embed")) == (1,)
    assert contracted_axes(("layers", "embed")) is None                           # norm


def test_int8_logits_close_to_fp32_and_fewer_bits_worse(tiny):
    model, params, tokens = tiny
    apply = jax.jit(model.apply)
    ref = apply(params, tokens)
    err = {b: float(jnp.max(jnp.abs(apply(Q.dequantize(Q.quantize(params, model.logical, b)),
                                          tokens) - ref)) / jnp.max(jnp.abs(ref)))
           for b in (8, 6, 4)}
    assert 0 < err[8] < INT8_LOGIT_RTOL, err
    assert err[4] > err[6] > err[8], err


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_error_per_element_within_half_a_step(tiny, bits):
    model, params, _ = tiny
    q = Q.quantize(params, model.logical, bits)
    dq = Q.dequantize(q)
    qs = jax.tree.leaves(q, is_leaf=lambda x: isinstance(x, Q.QTensor))
    ws = jax.tree.leaves(params)
    for t, w, d in zip(qs, ws, jax.tree.leaves(dq)):
        if not isinstance(t, Q.QTensor):
            np.testing.assert_array_equal(d, w)              # norm scales untouched
            continue
        assert np.all(np.abs(np.asarray(w) - np.asarray(d)) <= np.asarray(t.scale) / 2 + 1e-7)
        # the largest |w| of each channel is exact (q = +-qmax)
        amax = np.max(np.abs(np.asarray(w)), axis=tuple(np.where(np.array(t.scale.shape) == 1)[0]
                                                         ), keepdims=True)
        np.testing.assert_allclose(np.asarray(t.scale) * (2 ** (bits - 1) - 1), amax, rtol=1e-6)


def test_bytes_are_a_quarter_plus_scales(tiny):
    model, params, _ = tiny
    weights = _weights(model, params)
    w_elems = sum(w.size for _, _, w in weights)
    other = Q.nbytes(params) - 4 * w_elems                   # norm scales, kept fp32
    channels = sum(w.size // int(np.prod([w.shape[i] for i in contracted_axes(n)]))
                   for _, n, w in weights)
    q8, q4 = Q.quantize(params, model.logical, 8), Q.quantize(params, model.logical, 4)
    assert Q.nbytes(q8) == other + (4 * w_elems) // 4 + 4 * channels
    assert Q.nbytes(q4) == other + sum((w.size + 1) // 2 for _, _, w in weights) + 4 * channels
    assert Q.nbytes(Q.quantize(params, model.logical, 6)) == Q.nbytes(q8)   # held in int8
    by_path = {jax.tree_util.keystr(p): t for p, t in jax.tree_util.tree_leaves_with_path(
        q8, is_leaf=lambda x: isinstance(x, Q.QTensor)) if isinstance(t, Q.QTensor)}
    assert by_path["['layers']['attn']['wo']"].scale.shape == (2, 1, 1, 128)
    assert by_path["['layers']['mlp']['w_up']"].scale.shape == (2, 1, 384)
    assert by_path["['embed']"].scale.shape == (320, 1)
    assert by_path["['embed']"].values.dtype == jnp.int8


def test_fake_quantize_forward_and_straight_through_gradient(tiny):
    model, params, _ = tiny
    fq = Q.fake_quantize(params, model.logical, 4)
    for a, b in zip(jax.tree.leaves(fq), jax.tree.leaves(
            Q.dequantize(Q.quantize(params, model.logical, 4)))):
        np.testing.assert_allclose(a, b, atol=1e-7)
    g = jax.jit(jax.grad(lambda p: sum(jnp.sum(x * 3.0) for x in jax.tree.leaves(
        Q.fake_quantize(p, model.logical, 4)))))(params)
    assert all(np.all(np.asarray(x) == 3.0) for x in jax.tree.leaves(g))


@pytest.mark.parametrize("s", [0.25, 0.5, 0.7])
def test_magnitude_masks_exact_sparsity_per_matrix(tiny, s):
    model, params, _ = tiny
    masks = M.magnitude_masks(params, model.logical, s)
    assert masks["embed"] is None and masks["norm"]["scale"] is None
    for path, names, w in _weights(model, params):
        mk = _at(masks, path)
        if is_lookup(names):
            assert mk is None
            continue
        stacked = names[0] == "layers"
        for layer in range(w.shape[0] if stacked else 1):   # each stacked index is a matrix
            m, a = np.asarray(mk[layer] if stacked else mk), np.abs(np.asarray(
                w[layer] if stacked else w))
            assert (~m).sum() == round(s * m.size), path
            assert a[m].min() >= a[~m].max(), path     # the smallest were cut
    pruned = M.apply(params, masks)
    assert M.sparsity(pruned, masks) == pytest.approx(s, abs=1e-3)


def test_magnitude_masks_global_exact_count(tiny):
    model, params, _ = tiny
    masks = M.magnitude_masks(params, model.logical, 0.6, scope="global")
    ms = [np.asarray(m) for m in jax.tree.leaves(masks)]
    total = sum(m.size for m in ms)
    assert sum((~m).sum() for m in ms) == round(0.6 * total)
    per = [(~m).mean() for m in ms]
    assert max(per) - min(per) > 0.05                # one threshold: tensors differ


def test_two_four_masks_along_the_contracted_axis(tiny):
    model, params, _ = tiny
    masks = M.nm_masks(params, model.logical)
    pruned = M.apply(params, masks)
    for path, names, w in _weights(model, params):
        if is_lookup(names):
            assert _at(masks, path) is None
            continue
        ax = contracted_axes(names)[-1]
        groups = np.moveaxis(np.asarray(_at(pruned, path)), ax, -1).reshape(-1, 4)
        assert np.all((groups != 0).sum(-1) == 2), path
        orig = np.abs(np.moveaxis(np.asarray(w), ax, -1).reshape(-1, 4))
        kept = groups != 0
        assert np.all(np.where(kept, orig, np.inf).min(-1) >= np.where(kept, -np.inf, orig)
                      .max(-1)), path
    # along another axis the groups are not 2:4 (the mask is not just "half of everything")
    wq = np.asarray(pruned["layers"]["attn"]["wq"])          # contracted: embed (axis 1)
    other = np.moveaxis(wq, 3, -1).reshape(-1, 4)
    assert not np.all((other != 0).sum(-1) == 2)


def test_sparsity_schedule():
    f = lambda t: float(M.sparsity_ramp(t, start=10, end=110, final=0.8))
    assert f(0) == 0.0 and f(10) == 0.0
    assert f(110) == pytest.approx(0.8) and f(500) == pytest.approx(0.8)
    assert f(60) == pytest.approx(0.8 * (1 - 0.5 ** 3))
    vals = [f(t) for t in range(0, 120, 5)]
    assert all(b >= a for a, b in zip(vals, vals[1:]))
    assert float(M.sparsity_ramp(10, 10, 20, 0.9, initial=0.5)) == pytest.approx(0.5)


def test_distillation_loss():
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
    t = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
    mask = jnp.asarray([[1, 1, 0], [1, 0, 1]], jnp.float32)
    assert abs(float(distill.distillation_loss(s, s, 1.0, mask))) < 1e-6
    assert float(distill.distillation_loss(s, t, 1.0, mask)) > 0.01
    assert float(distill.distillation_loss(s, t, 2.0, mask)) > 0.01
    # masked tokens do not count
    s2 = s.at[0, 2].add(5.0)
    assert float(distill.distillation_loss(s2, t, 2.0, mask)) == pytest.approx(
        float(distill.distillation_loss(s, t, 2.0, mask)), rel=1e-6)
    # gradient w.r.t. the student vs central differences; none into the teacher
    loss = jax.jit(lambda x: distill.distillation_loss(x, t, 2.0, mask))
    g = np.asarray(jax.grad(loss)(s))
    eps = 1e-2
    for idx in [(0, 0, 0), (0, 1, 3), (1, 2, 6), (1, 0, 2)]:
        fd = (float(loss(s.at[idx].add(eps))) - float(loss(s.at[idx].add(-eps)))) / (2 * eps)
        assert g[idx] == pytest.approx(fd, rel=2e-3, abs=1e-5), idx
    assert np.all(g[0, 2] == 0)
    assert np.all(
        np.asarray(jax.grad(lambda x: distill.distillation_loss(s, x, 2.0, mask))(t)) == 0)
    # combined objective: alpha (the teacher's weight, as train.distill_alpha) = 1 is the
    # distillation loss, alpha = 0 the cross entropy
    y = jnp.asarray(rng.integers(0, 7, (2, 3)))
    l0, parts = distill.objective(s, t, y, mask, alpha=0.0, temperature=2.0)
    assert float(l0) == pytest.approx(float(parts["ce"]))
    l1, _ = distill.objective(s, t, y, mask, alpha=1.0, temperature=2.0)
    assert float(l1) == pytest.approx(float(loss(s)))
    traced = jax.jit(lambda a, T: distill.objective(s, t, y, mask, a, T)[0])(1.0, 2.0)
    assert float(traced) == pytest.approx(float(l1), rel=1e-6)      # alpha, T may be traced


def test_bad_inputs_name_the_argument(tiny):
    model, params, _ = tiny
    for s in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"sparsity=.*\[0, 1\)"):
            M.magnitude_masks(params, model.logical, s)
    with pytest.raises(ValueError, match=r"final=1.0 must be in \[0, 1\)"):
        M.sparsity_ramp(0, 0, 10, final=1.0)
    with pytest.raises(ValueError, match="end=10 must be after start=10"):
        M.sparsity_ramp(0, 10, 10, final=0.5)
    with pytest.raises(ValueError, match="scope="):
        M.magnitude_masks(params, model.logical, 0.5, scope="row")
    for bits in (5, 2, 16):
        with pytest.raises(ValueError, match=f"bits={bits}.*(4, 6, 8)"):
            Q.quantize(params, model.logical, bits)
    with pytest.raises(ValueError, match=r"\['w'\].*'embed', size 6.*divisible by m=4"):
        M.nm_masks({"w": jnp.ones((6, 8))}, {"w": P("embed", "mlp")})
    with pytest.raises(ValueError, match="temperature=0"):
        distill.distillation_loss(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2, 3)), 0)
    with pytest.raises(ValueError, match="alpha=1.5"):
        distill.objective(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), int),
                            alpha=1.5)


def _at(tree, keystr):
    for k in keystr.strip("[]").split("]["):
        tree = tree[k.strip("'")]
    return tree
