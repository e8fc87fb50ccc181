"""The numerics harness catches broken plans: its negative controls.

A plan whose gradient reduction is dropped, or that sums where it should average, must fail
`numerics.assert_matches` against one device. The second control is one a comparison of losses
and weights alone would pass: AdamW's step is invariant to the gradient's scale, so only the
gradient comparison sees it.
"""
import jax
import pytest

from jaxscale import plan as plan_lib
from jaxscale.strategies.dp import region
from tests import numerics

DP8 = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1")


@pytest.fixture(scope="module")
def reference():
    return numerics.one_device()


def _with_mean(monkeypatch, mean):
    """The dp8 plan whose gradient mean over dp is `mean(local grads, state, inputs)`, through
    the step's own data region (`strategies.dp.region`): a sabotaged reduction."""
    real = plan_lib.step_parts

    def step_parts(spec):
        return real(spec).set("reduce", lambda grads_fn, ctx: region.make(
            grads_fn, ctx, ("dp",), mean=mean, mean_axes=("dp",)), by="the test's sabotage")
    monkeypatch.setattr(plan_lib, "step_parts", step_parts)
    return numerics.run(DP8)


def test_the_plan_itself_passes(reference):
    numerics.assert_matches(numerics.run(DP8), reference)


def test_a_dropped_reduction_fails(monkeypatch, reference):
    got = _with_mean(monkeypatch, lambda g, state, batch: (g, state))   # each device's own
    with pytest.raises(AssertionError, match="differs from one device"):
        numerics.assert_matches(got, reference)
    d = numerics.compare(got, reference)
    assert d["grads"] > 0.1 and d["params_mean"] > 0.05, d


def test_a_sum_instead_of_a_mean_fails_on_the_gradients_alone(monkeypatch, reference):
    got = _with_mean(monkeypatch, lambda g, state, batch: (jax.lax.psum(g, "dp"), state))
    d = numerics.compare(got, reference)
    assert abs(d["grads"] - 7) < 1e-3, d          # 8x the mean: 7x its size off
    # AdamW normalises the scale away: losses and weights alone would not see it
    assert d["loss"] < 1e-4 and d["params_mean"] < 0.01, d
    with pytest.raises(AssertionError, match="grads"):
        numerics.assert_matches(got, reference)
