"""Every plan computes what one device computes: 3 AdamW updates, losses, gradients and weights
(`tests/numerics.py`)."""
import pytest

from tests import numerics
from tests.helpers import PLANS

KV8 = ("model.n_kv_heads=8",)


@pytest.fixture(scope="module")
def reference():
    return numerics.one_device(*KV8)


@pytest.mark.parametrize("plan", PLANS)
def test_plan_matches_single_device(plan, reference):
    numerics.assert_matches(numerics.run((*PLANS[plan], *KV8)), reference)
