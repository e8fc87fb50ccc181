import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale import models
from jaxscale.train.state import FunctionalModel
from jaxscale.train.step import token_loss

EXPECTED = {"llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
            "llama3-405b": 405_853_388_800, "llama3.1-8b": 8_030_261_248}


@pytest.mark.parametrize("name, count", EXPECTED.items())
def test_published_parameter_counts_exact(name, count):
    assert models.get(name).param_count() == count


def test_param_count_matches_the_built_model():
    for kw in ({}, {"tie_embeddings": True}, {"n_kv_heads": 1}):
        cfg = dataclasses.replace(models.get("tiny"), **kw)
        fm = FunctionalModel(cfg)
        assert sum(x.size for x in jax.tree.leaves(fm.abstract_params)) == cfg.param_count()


def test_causality_gradient_is_exactly_zero():
    """d loss(position i) / d embedding(token at j > i) == 0 exactly."""
    cfg = dataclasses.replace(models.get("tiny"), n_layers=2)
    fm = FunctionalModel(cfg)
    params = fm.init(jax.random.key(0))
    T, i = 16, 7
    # tokens at positions > i use ids that never occur at positions <= i, and vice versa
    tokens = jnp.concatenate([jnp.arange(10, 10 + i + 1), jnp.arange(100, 100 + T - i - 1)])[None]
    targets = jnp.roll(tokens, -1, axis=1)
    mask = jnp.zeros((1, T)).at[0, i].set(1.0)

    def loss_i(p):
        return token_loss(fm.apply(p, tokens), targets, mask)[0]

    g = jax.grad(loss_i)(params)["embed"]
    future = np.asarray(g[100:100 + T - i - 1])
    past = np.asarray(g[10:10 + i + 1])
    assert np.all(future == 0.0)
    assert np.abs(past).max() > 0
    # and changing future tokens leaves earlier logits bit-identical
    other = tokens.at[0, i + 1:].set(5)
    np.testing.assert_array_equal(fm.apply(params, tokens)[0, :i + 1],
                                  fm.apply(params, other)[0, :i + 1])


def test_scan_and_unrolled_layers_agree():
    cfg = dataclasses.replace(models.get("tiny"), n_layers=3)
    scan, loop = FunctionalModel(cfg), FunctionalModel(dataclasses.replace(cfg, scan_layers=False))
    p = scan.init(jax.random.key(1))
    q = {**p, "layers": {i: jax.tree.map(lambda x: x[i], p["layers"]) for i in range(3)}}
    tok = jax.random.randint(jax.random.key(2), (2, 12), 0, cfg.vocab_size)
    np.testing.assert_allclose(scan.apply(p, tok), loop.apply(q, tok), rtol=1e-5, atol=1e-5)


def test_rope_scaling_changes_only_low_frequencies():
    from jaxscale.models.llama import rope_frequencies
    base = models.get("llama3-8b")
    scaled = models.get("llama3.1-8b")
    a, b = np.asarray(rope_frequencies(base)), np.asarray(rope_frequencies(scaled))
    assert np.allclose(a[:8], b[:8])                       # high frequencies kept
    assert np.allclose(a[-4:] / 8.0, b[-4:])               # lowest divided by factor 8
