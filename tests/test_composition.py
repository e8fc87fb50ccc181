"""The composition table: every pair of 28 plan options validated as `train` validates a plan.

Every refusal between options that involve neither the pipeline nor mixture-of-experts is one
that no implementation could run, named in `REASONS` with why, or one of the few `PENDING`
(to be built); `docs/composition.md` is the table the code gives today.
"""
import pytest

from jaxscale.analysis import composition


@pytest.fixture(scope="module")
def table():
    return composition.table()


def test_every_pair_is_validated(table):
    assert len(composition.OPTIONS) == 28 and len(table) == 378


def test_every_pipeline_pair_is_accepted_or_refused_for_a_reason(table):
    """The pipeline composes with every other option (the refusals left are the mixture of
    experts' own, and those with a reason no implementation avoids)."""
    left = {pair: msg for pair, msg in table.items()
            if msg and composition.owner(*pair) == "pipeline"
            and composition.reason(msg) is None}
    assert not left, left


def test_every_data_and_layout_refusal_has_a_reason_no_implementation_avoids(table):
    """... or is listed as pending (to be built), and the pending list is exactly what is
    still refused: a pair built leaves it, a new refusal cannot join it unnoticed."""
    unexplained = {pair for pair, msg in table.items()
                   if msg and composition.owner(*pair) == "data and layout"
                   and composition.reason(msg) is None}
    assert unexplained == set(composition.PENDING), unexplained ^ set(composition.PENDING)


def test_each_reason_is_still_given(table):
    used = {composition.reason(m) for m in table.values() if m}
    assert set(composition.REASONS) <= used, set(composition.REASONS) - used


def test_a_refused_pair_says_how_to_fix_it(table):
    for pair, msg in table.items():
        if msg and composition.owner(*pair) == "data and layout":
            assert "plan." in msg and ("set " in msg or "use " in msg or "choose" in msg), msg


def test_the_committed_page_is_the_table(table):
    assert composition.DOC.read_text() == composition.markdown(table), (
        "docs/composition.md is stale: python -m jaxscale.analysis.composition --update-docs")


def test_a_refusal_names_both_settings():
    msg = composition.pair("DiLoCo", "sparse embedding")
    assert "no gradient mean to replace" in msg
    assert "plan.sparse_embedding" in msg and "plan.local_sgd=diloco" in msg
