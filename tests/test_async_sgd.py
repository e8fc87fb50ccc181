"""Asynchronous SGD (`jaxscale.comm.async_sgd`, plain NumPy): the stale-gradient stability bound
against a measured divergence, the parameter-server simulator's staleness, staleness-aware steps,
and the sparse (recommender-style) problem that tolerates staleness where a dense one diverges."""
import numpy as np
import pytest

from jaxscale.comm import async_sgd as A

QUAD = A.Quadratic.make(dim=16, h_max=1.0, h_min=0.1)


@pytest.mark.parametrize("delay", [0, 1, 3, 8])
def test_divergence_step_size_is_the_stability_bound(delay):
    bound = A.stable_lr(QUAD.h_max, delay)
    assert A.divergence_lr(QUAD, delay, steps=1500) == pytest.approx(bound, rel=0.02)
    assert np.isinf(A.delayed_sgd(QUAD, 1.1 * bound, delay, 3000)[-1])
    assert A.delayed_sgd(QUAD, 0.9 * bound, delay, 3000)[-1] < 1e-3 * QUAD.loss(QUAD.init())


def test_bound_values_and_zero_delay_is_gradient_descent():
    assert [round(A.stable_lr(1.0, k), 4) for k in (0, 1, 2)] == [2.0, 1.0, 0.618]
    x = QUAD.init()
    for _ in range(5):
        x = x - 0.5 * QUAD.grad(x)
    assert A.delayed_sgd(QUAD, 0.5, 0, 5)[-1] == pytest.approx(QUAD.loss(x))


def test_parameter_server_staleness_and_one_worker_is_sgd():
    one = A.parameter_server(QUAD, 1, 0.5, 50)
    assert not one.staleness.any()
    assert one.loss[-1] == pytest.approx(A.delayed_sgd(QUAD, 0.5, 0, 50)[-1])
    many = A.parameter_server(QUAD, 8, 0.05, 800)
    assert many.staleness[50:].mean() == pytest.approx(7, abs=0.5)      # n - 1 at equal speeds
    slow = A.parameter_server(QUAD, 4, 0.05, 800, speeds=[4, 1, 1, 1])
    assert slow.per_worker[0] > 2.5 * slow.per_worker[1:].max()


def test_staleness_aware_steps_converge_where_constant_steps_diverge():
    const = A.parameter_server(QUAD, 16, 1.0, 3000)
    aware = A.parameter_server(QUAD, 16, 1.0, 3000, lr_rule="staleness")
    assert np.isinf(const.loss[-1])
    assert aware.loss[-1] < 1e-6 * QUAD.loss(QUAD.init())


def test_sparse_embedding_updates_tolerate_staleness():
    emb = A.SparseEmbedding()
    start = emb.loss(emb.init())
    for n in (1, 32):
        r = A.parameter_server(emb, n, 2.0, 2000)
        assert r.loss[-1] < 0.15 * start, n
    assert A.parameter_server(emb, 32, 2.0, 200).staleness[100:].mean() > 25


@pytest.mark.parametrize("call, message", [
    (lambda: A.delayed_sgd(QUAD, 0.1, -1, 10), "need delay >= 0"),
    (lambda: A.parameter_server(QUAD, 0, 0.1, 10), "need n_workers >= 1"),
    (lambda: A.parameter_server(QUAD, 2, 0.1, 10, lr_rule="adaptive"), "lr_rule='adaptive'"),
    (lambda: A.parameter_server(QUAD, 2, 0.1, 10, speeds=[1, 0]), "2 positive numbers"),
    (lambda: A.stable_lr(0.0, 1), "curvature > 0"),
])
def test_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call()
