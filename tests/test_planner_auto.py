"""Cluster names, the search over what users choose (precision, ZeRO++, stage layouts, offload)
and the train command line it ends with, and `--plan auto` on the 8 simulated CPU devices: the
fastest plan compiled and checked before the first step, the next one where it does not fit."""
import json
import shlex

import pytest

from jaxscale import config as C
from jaxscale import meshes, models, planner
from jaxscale.analysis import autoplan
from jaxscale.cli import main, parser
from jaxscale.plan import Spec, problems, unavailable
from jaxscale.planner import search, space
from tests.helpers import SMALL_ARGS, tiny_config


# ----------------------------------------------------------------------------- cluster names
def test_cluster_names_give_the_hardware_devices_and_node_split():
    m = meshes.get("h100x8x8")
    assert (m.device_kind, m.dp, m.fsdp, m.tp, m.dcn_dp, m.nodes) == ("h100", 8, 8, 1, 8, 8)
    assert meshes.devices("h100x8x8") == 64 and meshes.devices("h200x8x32") == 256
    a100 = meshes.get("a100x8x4").resolve(32)
    assert (a100.device_kind, a100.nodes, a100.fsdp) == ("a100", 4, 8)
    assert meshes.get("h100x4").degrees() == {"dp": 1, "pp": 1, "fsdp": 4, "ep": 1, "sp": 1,
                                              "tp": 1}
    assert meshes.get("h100x8x4") == meshes.PRESETS["h100x8x4"]       # the preset's own tp=4
    # as --set mesh=NAME, then its degrees changed: the node split stays
    cfg = C.apply_overrides(C.Config(), ["mesh=h100x8x8", "mesh.fsdp=1", "mesh.tp=8"])
    spec = Spec.from_config(cfg, meshes.devices("h100x8x8"))
    assert (spec.deg("tp"), spec.deg("dp"), spec.dcn["dp"], spec.device_kind) == (8, 8, 8, "h100")


@pytest.mark.parametrize("name, why", [
    ("h100x8x", "give both counts as numbers"),
    ("h900x8x2", "unknown device kind 'h900'"),
    ("h100x0x2", "gpus per node and nodes must be at least 1"),
    ("h100x9", "a h100 node holds at most 8 devices"),
    ("h100x8x2x2", "at most two counts"),
])
def test_a_malformed_cluster_name_lists_the_presets_and_the_pattern(name, why):
    with pytest.raises(ValueError) as err:
        meshes.get(name)
    msg = str(err.value)
    assert msg.startswith(f"unknown mesh preset {name!r}; valid: cpu8")
    assert why in msg and "<kind>x<gpus-per-node>x<nodes>" in msg
    assert all(p in msg for p in meshes.PRESETS)


def test_plan_holds_a_cluster_names_device_count(capsys, tmp_path):
    argv = ["plan", "--model", "llama3-8b", "--mesh", "h200x8x2", "--seq", "4096", "--batch",
            "16", "--out", str(tmp_path), "--json"]
    assert main(argv + ["--set", "mesh.tp=8"]) == 2                 # dp2 x fsdp8 x tp8
    assert "= 128 devices but 16 are present" in capsys.readouterr().err
    assert main(argv + ["--set", "mesh.fsdp=-1", "--set", "mesh.tp=8"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["devices"], rep["hardware"], rep["mesh"]["dp"], rep["mesh"]["fsdp"],
            rep["mesh"]["tp"]) == (16, "h200", 2, 1, 8)


# ----------------------------------------------------------------------------- the search
@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """`plan --search` for llama3-8b on two nodes of 8 H200s: its printed text and plan.json."""
    out = tmp_path_factory.mktemp("search")
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["plan", "--model", "llama3-8b", "--mesh", "h200x8x2", "--seq", "4096",
                     "--batch", "32", "--search", "--out", str(out)])
    assert code == 0
    return buf.getvalue(), json.loads((out / "plan.json").read_text())


def test_search_ranks_bf16_and_fp8_above_fp32_on_gpus(searched):
    _, payload = searched
    shown = payload["accepted"]
    assert all(p["plan"].endswith(" bf16") for p in shown)          # no fp32 plan on a GPU
    assert any("qat-fp8" in p["plan"] for p in shown)               # H200: fp8 matmul units
    assert any("qat" not in p["plan"] for p in shown)
    cfg = C.apply_overrides(C.Config(model=models.get("llama3-8b"), mesh=meshes.get("h200x8x2")),
                            ["data.seq_len=4096", "data.batch_size=32"])
    fp32 = search.search(cfg, fixed=("precision",))                 # the user asked for fp32
    assert fp32.accepted and all(p.spec.precision == "fp32" for p in fp32.accepted)
    assert shown[0]["time"]["total"] < fp32.accepted[0].time.total
    best_bf16 = min(p["time"]["total"] for p in shown if "qat" not in p["plan"])
    assert best_bf16 < fp32.accepted[0].time.total
    cpu = search.search(tiny_config(), 8)                           # CPU: as configured
    assert {(p.spec.precision, p.spec.qat) for p in cpu.accepted} == {("fp32", "none")}


def test_search_ends_with_a_train_command_that_train_accepts(searched):
    text, payload = searched
    line = text.strip().splitlines()[-1]
    assert line == payload["command"] and line.startswith("jaxscale train llama_tiny ")
    argv = shlex.split(line)[1:]
    args = parser().parse_args(argv)
    assert "model=llama3-8b" in args.set and "mesh=h200x8x2" in args.set
    cfg, errs = C.apply_each(C.load_experiment(args.experiment), args.set)
    assert errs == [] and C.check(cfg) == []
    spec = Spec.from_config(cfg, 16)
    assert problems(spec) == [] and unavailable(spec) == []
    planner.check_fits(cfg, 16)
    top = payload["accepted"][0]
    pred = planner.predict(cfg, 16)
    assert spec.label() == top["plan"]
    assert pred.time.total == pytest.approx(top["time"]["total"], rel=1e-12)
    assert pred.memory.total == pytest.approx(top["memory"]["total"], rel=1e-12)


@pytest.mark.parametrize("cfg", [
    tiny_config(),
    C.apply_overrides(C.Config(model=models.get("llama3-8b"), mesh=meshes.get("h100x8")),
                      ["data.seq_len=4096", "data.batch_size=16"]),
], ids=["tiny-cpu8", "llama3-8b-h100x8"])
def test_the_pruned_search_finds_the_exhaustive_searchs_fastest_plan(cfg):
    pruned, every = search.search(cfg), search.search(cfg, exhaustive=True)
    assert pruned.expanded < every.expanded and pruned.pruned > 0
    assert pruned.accepted[0].spec.label() == every.accepted[0].spec.label()
    assert pruned.accepted[0].time.total == every.accepted[0].time.total


def test_offload_only_when_nothing_fits_without():
    base = C.Config(model=models.get("llama3-70b"), mesh=meshes.get("h100x8"))
    res = search.search(C.apply_overrides(base, ["data.seq_len=4096", "data.batch_size=8"]))
    assert res.accepted and all(p.spec.offload != "none" for p in res.accepted)
    assert all(p.memory.total <= p.capacity for p in res.accepted)
    roomy = search.search(C.apply_overrides(C.Config(model=models.get("llama3-8b"),
                                                     mesh=meshes.get("h100x8")),
                                            ["data.seq_len=2048", "data.batch_size=8"]))
    assert roomy.accepted and all(p.spec.offload == "none" for p in roomy.accepted)


def test_zeropp_and_uneven_stage_layouts_are_searched_where_they_apply():
    cfg = C.apply_overrides(C.Config(model=models.get("llama3-405b"), mesh=meshes.get(
        "h100x8x16")), ["data.seq_len=4096", "data.batch_size=512", "plan.precision=bf16"])
    opts = space.options(Spec.from_config(cfg))
    hybrid = Spec.from_config(cfg).with_(zero=3)                    # dp across, fsdp inside
    assert "all" in space.zeropp_options(hybrid, opts)               # hpZ too
    assert space.zeropp_options(hybrid.with_(degrees=dict(hybrid.degrees, dp=1, fsdp=128),
                                             dcn=dict(hybrid.dcn, dp=1, fsdp=16)), opts) == \
        ["qwz", "qgz", "qwz+qgz"]
    assert space.zeropp_options(hybrid.with_(dcn=dict(hybrid.dcn, dp=1)), opts) == []  # 1 node
    pp = hybrid.with_(degrees=dict(hybrid.degrees, dp=8, pp=16, fsdp=1),
                      dcn=dict(hybrid.dcn, dp=8, pp=2), zero=1, accumulate=32)
    from jaxscale.strategies.pp import stages
    auto = stages.counts(pp)
    assert auto[0] == auto[-1] == 7 and set(auto[1:-1]) == {8}      # 126 layers, balanced
    even = space.stage_layouts(pp, opts)
    assert even == [",".join(map(str, stages.even(126, 16)))] and problems(
        pp.with_(stage_layers=even[0])) == []


# ----------------------------------------------------------------------------- --plan auto
TRAIN_SETS = [a for a in SMALL_ARGS if a != "--set"] + ["train.steps=2"]


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """`jaxscale train llama_tiny --plan auto --steps 2` (the small CLI run): its directory."""
    out = tmp_path_factory.mktemp("auto") / "run"
    assert main(["train", "llama_tiny", "--plan", "auto", "--steps", "2", "--out", str(out),
                 *SMALL_ARGS]) == 0
    return out


def test_plan_auto_picks_compiles_and_trains(auto_run, capsys):
    summary = json.loads((auto_run / "summary.json").read_text())
    rec = summary["plan_auto"]
    assert summary["steps"] == 2 and rec["rank"] == 1 and rec["passed_over"] == []
    assert 0 < rec["compiled"]["total"] <= rec["capacity_bytes"]
    assert rec["compiled"]["ratio_to_predicted"] == pytest.approx(
        rec["compiled"]["total"] / rec["predicted"]["memory_bytes"])
    # config.json holds the chosen plan: the experiment's config with the choice's overrides
    saved = C.from_dict(json.loads((auto_run / "config.json").read_text()))
    cfg = C.apply_overrides(C.load_experiment("llama_tiny"), TRAIN_SETS + rec["overrides"])
    assert saved.mesh == cfg.mesh.resolve(8) and saved.plan == cfg.plan
    assert Spec.from_config(saved).label() == rec["chosen"]
    rows = [json.loads(line) for line in (auto_run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)


def test_plan_auto_falls_back_when_the_compiled_step_does_not_fit(auto_run, monkeypatch):
    first = json.loads((auto_run / "summary.json").read_text())["plan_auto"]
    cfg = C.apply_overrides(C.load_experiment("llama_tiny"), TRAIN_SETS)
    lines = []
    cap = first["compiled"]["total"] - 1            # the top plan's compiled step is 1 B over
    chosen, rec = autoplan.choose(cfg, capacity=cap, say=lines.append)
    over = rec["passed_over"][0]
    assert over["rank"] == 1 and over["plan"] == first["chosen"] and over["compiled"]
    assert over["reason"].startswith("compiled step needs")
    assert f"({first['compiled']['total']:,} B) per device > capacity" in over["reason"]
    assert f"({cap:,} B)" in over["reason"]
    assert rec["rank"] > 1 and rec["chosen"] != first["chosen"]
    assert rec["compiled"]["total"] <= cap
    assert any("passed over #1" in line for line in lines)
    assert Spec.from_config(chosen, 8).label() == rec["chosen"]
    # a plan that does not compile is passed over with the error, the next one taken
    from jaxscale.train import setup
    build, calls = setup.build, []

    def failing(cfg, devices=None, **kw):
        calls.append(cfg)
        if len(calls) == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling")
        return build(cfg, devices, **kw)
    monkeypatch.setattr(setup, "build", failing)
    _, rec = autoplan.choose(cfg)
    assert rec["rank"] == 2 and rec["passed_over"][0]["reason"] == (
        "does not compile: RuntimeError: RESOURCE_EXHAUSTED: out of memory while compiling")


def test_inspect_plan_auto_reports_the_choice(auto_run, capsys):
    first = json.loads((auto_run / "summary.json").read_text())["plan_auto"]
    assert main(["inspect", "llama_tiny", "--plan", "auto", "--json", *SMALL_ARGS]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["plan_auto"]["chosen"] == first["chosen"]
    assert rep["memory"]["total"] == rep["plan_auto"]["compiled"]["total"]
