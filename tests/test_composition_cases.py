"""The other half of the CI's generated layouts (`test_composition.CI_SEEDS`), in a file of its
own so that a second worker runs them."""
import pytest

from tests.test_composition import CI_SEEDS, HERE


@pytest.mark.parametrize("seed", [s for s in CI_SEEDS if s not in HERE])
def test_a_generated_layout_trains_like_its_reference_and_moves_its_formula(seed):
    from jaxscale.analysis import generate
    res = generate.check(generate.draw(seed))
    assert res.ok, f"{res.failure}: {res.detail}\n  {res.case.command()}"
