"""The composition table: every pair of 28 plan options validated as `train` validates a plan.

Every refusal between options that involve neither the pipeline nor mixture-of-experts is one
that no implementation could run, named in `REASONS` with why, or one of the few `PENDING`
(to be built); `docs/composition.md` is the table the code gives today.
"""
import dataclasses
import json

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
    assert composition.table_part(composition.DOC.read_text()) == composition.markdown(table), (
        "docs/composition.md is stale: python -m jaxscale.analysis.composition --update-docs")


def test_a_refusal_names_both_settings():
    msg = composition.pair("DiLoCo", "sparse embedding")
    assert "no gradient mean to replace" in msg
    assert "plan.sparse_embedding" in msg and "plan.local_sgd=diloco" in msg


# ----------------------------------------------------------------------------- generated layouts
#: seeds that pass whole and together hold every option: the quickest such nine found among the
#: sweep's passes (docs/composition_sweep.jsonl; 13-58 s a case here, 2:42 for the nine on
#: two workers); four run here, five in `test_composition_cases.py`
CI_SEEDS = (1024, 1113, 1104, 1109, 1032, 2998, 1121, 1037, 1118)
HERE = CI_SEEDS[:4]


def test_the_cover_holds_every_option():
    from jaxscale.analysis import generate
    held = {o for s in CI_SEEDS for o in generate.draw(s).options}
    assert held == set(composition.OPTIONS), set(composition.OPTIONS) - held


def test_a_case_is_drawn_from_its_seed_alone():
    from jaxscale.analysis import generate
    a, b = generate.draw(7), generate.draw(7)
    assert a == b and a != generate.draw(8)
    assert 3 <= len(a.options) <= 6 and a.command().startswith("jaxscale train llama_tiny")
    mesh = dict(a.mesh)
    assert mesh["dp"] * mesh["pp"] * mesh["fsdp"] * mesh["ep"] * mesh["sp"] * mesh["tp"] == 8


@pytest.mark.parametrize("seed", HERE)
def test_a_generated_layout_trains_like_its_reference_and_moves_its_formula(seed):
    """3 real updates against the reference within the methods' bounds, the census row by row
    against the formulas, compiled memory and FLOPs against the planner
    (`jaxscale.analysis.generate.check`); a failure prints the command that reproduces it."""
    from jaxscale.analysis import generate
    res = generate.check(generate.draw(seed))
    assert res.ok, f"{res.failure}: {res.detail}\n  {res.case.command()}"


def test_tolerances_of_several_sources_add_and_part_the_weights():
    """`harness.combine`: bounds add; with two lossy sources, or one and quantised operands
    (whose rare flips need equal weights), only the first update's gradients are compared;
    fp8 QAT of 16-bit values is itself lossy (`generate.tolerance`)."""
    from jaxscale.analysis import generate
    from jaxscale.analysis import harness as N
    both = N.combine([N.FP32, N.BF16, N.COMPRESSION["int8"]])
    assert both.grads == pytest.approx(1e-5 + 3e-2 + 8 / 254) and both.grad_steps == 1
    assert N.combine([N.FP32, N.COMPRESSION["int8"]]).grad_steps is None
    assert N.combine([N.FP32, N.QAT_INT8]).grad_steps is None
    assert N.combine([N.FP32, N.QAT_FP8, N.COMPRESSION["int8"]]).grad_steps == 1
    assert N.combine([N.FP32, N.MOE]).grad_steps is None      # a router's choices alone
    assert N.combine([N.FP32, N.MOE, N.BF16]).grad_steps == 1  # ... beside a lossy source
    case = generate.draw(41)                    # fp16 and fp8 QAT among its options
    assert {"fp16", "QAT fp8"} <= set(case.options)
    assert generate.tolerance(case).grads == pytest.approx(     # dp, pp, sp, micro-batches:
        2e-5 + 3e-2 + 3e-5 + 8 / 254 + 2 ** -3)                   # fp32's 1e-5 x 4 / 2


def test_a_longer_run_widens_the_loss_and_weight_bounds_not_the_gradients():
    """`Tolerance.over`: local SGD's checks run 6 updates (its first average and a step), past
    the 3 the bounds are stated for; the loss and weight bounds grow with the updates, the
    gradients' (one update's, at equal weights) does not."""
    from jaxscale.analysis import harness as N
    zpp = N.ZEROPP["qwz+qgz"]
    six = zpp.over(6)
    assert (six.loss, six.params_mean, six.grads) == (2 * zpp.loss, 2 * zpp.params_mean,
                                                      zpp.grads)
    assert six.params_max is None and N.FP32.over(6).params_max == 2 * N.FP32.params_max
    assert N.FP32.over(N.STEPS) == N.FP32 == N.FP32.over(2)


def test_fp32_bound_grows_with_the_sums_split_and_stays_far_below_a_lost_reduction():
    """`generate.fp32`: FP32's 1e-5 of a leaf's largest gradient for up to two reordered sums
    (the mesh axes a gradient's sum is split over, and the micro-batches), half of it for each
    one more: dp2 x fsdp2 x tp2, three: 1.5e-5; the widest mesh of 8 devices with micro-batches
    (four axes of 2 and accumulation) 2.5e-5, while a reduction lost over an axis of 2 is off by
    half the gradient."""
    from jaxscale.analysis import generate
    case = generate.draw(1122)
    assert dict(case.mesh) == {"dp": 2, "pp": 1, "fsdp": 2, "ep": 1, "sp": 1, "tp": 2}
    assert generate.fp32(case).grads == pytest.approx(1.5e-5)
    flat = dataclasses.replace(case, mesh=(("dp", 8),))
    assert generate.fp32(flat).grads == 1e-5
    widest = dataclasses.replace(case, mesh=tuple((a, 2) for a in ("dp", "pp", "sp", "tp")),
                                 options=("accumulation",))
    assert generate.fp32(widest).grads == pytest.approx(2.5e-5)
    assert generate.fp32(widest).grads < 0.5 / 1000


def test_sweeps_run_apart_are_summarised_together(tmp_path, capsys):
    """`sweep --results`: the lines of sweeps run apart, one summary (each failure with its
    diagnosed cause, or none) and one section naming each run of seeds; a later file's row of
    a seed replaces an earlier one's (a re-run after a fix); a file given twice is refused."""
    from jaxscale.analysis import sweep

    def line(seed, ok):
        return json.dumps({"seed": seed, "options": ["tp"], "ok": ok, "failure": "" if ok else
                           "census", "detail": "" if ok else "all-reduce tp 2x",
                           "command": f"jaxscale train llama_tiny # {seed}", "seconds": 1.0})
    (tmp_path / "a.jsonl").write_text(line(4, True) + "\n" + line(5, False) + "\n")
    (tmp_path / "b.jsonl").write_text(line(6, True) + "\n")
    assert sweep.main(["--results", str(tmp_path / "b.jsonl"), str(tmp_path / "a.jsonl")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("2 of 3 generated layouts pass (66.7%): census 1")
    assert "seed 5 (census; undiagnosed): all-reduce tp 2x" in out and "# 5`" in out
    (tmp_path / "fix.jsonl").write_text(line(5, True) + "\n")
    assert sweep.main(["--results", str(tmp_path / "a.jsonl"), str(tmp_path / "fix.jsonl")]) == 0
    assert capsys.readouterr().out.startswith("2 of 2 generated layouts pass (100.0%)")
    with pytest.raises(SystemExit):
        sweep.main(["--results", str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl")])
    assert "names a file more than once" in capsys.readouterr().err
    with pytest.raises(SystemExit):         # refused before any case compiles
        sweep.main(["--cases", "0"])
    assert "--cases 0: give at least 1 layout" in capsys.readouterr().err
    rows = [json.loads(x) for x in (line(4, True), line(5, False), line(9, True))]
    assert sweep.runs([r["seed"] for r in rows]) == [(4, 2), (9, 1)]
    rows = [{**r, "mesh": {"dp": 8}, "shape": {}} for r in rows]
    text = sweep.docs_section(rows)
    assert "`python -m jaxscale.analysis.sweep --cases 2 --seed 4` and `python -m " \
        "jaxscale.analysis.sweep --cases 1 --seed 9` draw 3 plans" in text


def test_the_reference_takes_the_cases_micro_batches():
    """A pipeline's micro-batches are the reference's too: a mixture's balance loss is a
    micro-batch's (seed 222, MoE x 1F1B x collective matmul: the router's gradient was 1.4%
    off one device run on the whole batch)."""
    from jaxscale.analysis import generate
    case = generate.draw(222)
    assert {"MoE", "pp 1F1B"} <= set(case.options)
    ref, n = generate.reference(case)
    assert n == 1 and "plan.accumulate=2" in ref and "mesh.pp=1" in ref
    assert "model.moe_experts=4" in ref


def test_a_failure_is_named_by_its_diagnosed_cause():
    from jaxscale.analysis import sweep
    row = {"failure": "memory", "options": ["fp16", "tp"], "mesh": {"pp": 1},
           "shape": {"model.n_layers": 4}, "temp": 1.27}
    assert sweep.cause(row) == "undiagnosed"
    assert sweep.cause({**row, "options": ["fp16", "accumulation"], "temp": 0.8}) == \
        "undiagnosed"       # fixed causes leave the list (float16 micro-batches')
    assert sweep.cause({**row, "options": ["fp16", "2:4 pruning"], "mesh": {"pp": 1, "tp": 4},
                        "temp": 0.8}) == "float16 with tp and pruning on XLA:CPU"
    row = {**row, "failure": "memory", "options": ["pp 1F1B"], "mesh": {"pp": 2},
           "shape": {"model.n_layers": 5}, "temp": 0.8}
    assert sweep.cause(row) == "undiagnosed"      # fixed causes leave the list (uneven stages')
    assert sweep.cause({**row, "options": ["pp 1F1B", "bf16"]}) == "16-bit pipeline residuals"
    assert sweep.cause({**row, "options": ["pp 1F1B", "bf16", "ring"], "temp": 1.2}) == \
        "16-bit ring attention on XLA:CPU"
    assert sweep.cause({**row, "options": ["pp 1F1B", "ring"], "temp": 1.2}) == "undiagnosed"
    assert sweep.cause({**row, "options": ["pp 1F1B", "DiLoCo"], "temp": 1.2}) == \
        "local SGD's average over sharded or pipelined replicas"
    assert sweep.cause({**row, "options": ["DiLoCo"], "mesh": {"dp": 8}, "temp": 1.2}) == \
        "undiagnosed"
    assert sweep.cause({**row, "failure": "numerics", "options": ["ep", "bf16"]}) == \
        "routing under rounding"
    assert sweep.cause({**row, "failure": "numerics", "detail": "grads 1.29e-05 > 1e-05 (worst: "
                        "...)"}) == "undiagnosed"      # fixed causes leave the list (fp32's)
    assert sweep.cause({**row, "failure": "crash", "options": ["bf16", "Megatron SP"]}) == \
        "undiagnosed"       # fixed causes leave the list (XLA:CPU's abort on SP's bf16 sums)
    assert sweep.cause({**row, "failure": "crash", "detail": "F1207 rendezvous.cc:161] [id=0] "
                        "Termination timeout for `all gather ..."}) == \
        "XLA:CPU collectives launched out of order"
    fp8 = {**row, "failure": "numerics", "options": ["QAT fp8", "tp"], "mesh": {"tp": 2},
           "detail": "params_mean 0.00499 > 0.002 (worst: ...)"}
    assert sweep.cause(fp8) == "fp8 QAT's roundings under tensor parallelism"
    assert sweep.cause({**fp8, "mesh": {"dp": 8}}) == "undiagnosed"
    low_rank = {**row, "failure": "numerics", "options": ["PowerSGD", "fsdp"],
                "detail": "loss 0.0302 > 0.03 (worst: ...)"}
    assert sweep.cause(low_rank) == "PowerSGD's loss on its bound"
    assert sweep.cause({**low_rank, "detail": "loss 0.04 > 0.03; params_mean 2 > 1"}) == \
        "undiagnosed"                           # only the loss at the bound
    assert sweep.cause({**row, "failure": "census", "options": ["collective matmul", "full remat"],
                        "detail": "all-to-all tp ..."}) == "undiagnosed"   # and a pipeline's rings


def test_a_case_that_aborts_its_process_is_a_crash_not_the_sweeps_end():
    """A case may end XLA:CPU's compiler with a check failure (seed 1128 once did: dp2 x tp4,
    bf16, Megatron SP, accumulation); each case runs in its own process, so the sweep records
    it and goes on."""
    import sys

    from jaxscale.analysis import sweep
    code = "import sys; sys.stderr.write('F1206 hlo_instruction.cc] Invalid\\n'); sys.exit(-6)"
    r = sweep.one(7, [sys.executable, "-c", code])
    assert (r["seed"], r["ok"], r["failure"]) == (7, False, "crash")
    assert r["detail"].startswith("F1206 hlo_instruction.cc] Invalid")
    assert r["command"].startswith("jaxscale train llama_tiny")
