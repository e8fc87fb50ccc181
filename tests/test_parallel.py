"""Every plan computes what one device computes: losses and gradients over 3 steps."""
import jax
import numpy as np
import pytest

from jaxscale.data import Batches, load_corpus
from jaxscale.train.setup import build
from tests.helpers import MESH_1, PLANS, tiny_config


def _trajectory(cfg, devices):
    setup = build(cfg, devices)
    corpus = load_corpus(cfg.data)
    batches = Batches(corpus.train, cfg.data.batch_size, cfg.data.seq_len, seed=0)
    grads_jit = setup.jit_grads()
    state = setup.init_state()
    losses, grads = [], []
    for i in range(3):
        batch = batches.device_batch(i, setup.batch_shardings())
        grads.append(jax.device_get(grads_jit(state.params, batch)[0]))
        state, m = setup.train_step(state, batch)
        losses.append(float(m["loss"]))
    return losses, grads, jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference():
    return _trajectory(tiny_config(*MESH_1, "model.n_kv_heads=8"), jax.devices()[:1])


@pytest.mark.parametrize("plan", PLANS)
def test_plan_matches_single_device(plan, reference):
    cfg = tiny_config(*PLANS[plan], "model.n_kv_heads=8")
    losses, grads, params = _trajectory(cfg, jax.devices())
    ref_losses, ref_grads, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
            scale = np.abs(b).max() + 1e-12
            assert np.abs(a - b).max() / scale < 1e-4
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=2e-5)
