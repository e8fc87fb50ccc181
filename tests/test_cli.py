"""The CLI end to end: inspect --json schema, a short training run's files, clear errors."""
import json

import pytest

from jaxscale.cli import main

SMALL = ["--set", "model.n_layers=2", "--set", "data.seq_len=32", "--set", "data.batch_size=8",
         "--set", "data.max_bytes=400000"]


def test_inspect_json_schema(capsys):
    assert main(["inspect", "llama_tiny", "--json", *SMALL]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {"memory", "collectives", "flops", "theory"} <= set(rep)
    assert all({"kind", "count", "bytes", "axes"} <= set(c) for c in rep["collectives"])
    assert rep["mesh"]["dp"] == 2 and rep["mesh"]["tp"] == 2


def test_train_writes_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "llama_tiny", "--steps", "4", "--out", str(out), *SMALL,
                 "--set", "train.eval_every=2", "--set", "train.eval_batches=1"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all({"loss", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "lr"} <= set(r)
               for r in rows)
    assert "eval_loss" in rows[0] and "eval_loss" in rows[-1]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mesh"]["dp"] == 2 and cfg["model"]["n_layers"] == 2 and cfg["train"]["steps"] == 4
    assert (out / "loss.png").stat().st_size > 1000
    assert list((out / "tb").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("argv, msg", [
    (["inspect", "nope"], "unknown experiment 'nope'"),
    (["inspect", "llama_tiny", "--set", "mesh.dp=3"],
     "mesh asks for dp=3 x fsdp=2 x tp=2 = 12 devices"),
    (["inspect", "llama_tiny", "--set", "model.nlayers=2"], "unknown config key 'model.nlayers'"),
    (["inspect", "llama_tiny", "--set", "mesh=tpu9"], "unknown mesh preset 'tpu9'"),
    (["inspect", "llama_tiny", "--set", "data.batch_size=6"], "not divisible by the data-parallel"),
    (["inspect", "llama_tiny", "--set", "model=llama3-8b"], "does not fit: it needs"),
    (["train", "llama_tiny", "--set", "plan.remat=sometimes"], "unknown plan.remat 'sometimes'"),
])
def test_cli_errors(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err
