"""Asynchronous training through the parameter server (`jaxscale.ps`): one worker at staleness 0
is synchronous training; N equal workers push about N - 1 updates late; a slow worker does not
hold the others back and its pushes are weighted by their staleness; a killed worker rejoins, a
killed server resumes from its checkpoint; bad input is refused before anything starts."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxscale.analysis.validation import tiny_config
from jaxscale.cli import main as cli_main
from jaxscale.data import make_batches
from jaxscale.ps.supervisor import run_in_process
from jaxscale.train.metrics import read_metrics
from jaxscale.train.setup import build
from tests.helpers import SMALL_ARGS, subprocess_env

ASYNC = ("train.eval_every=0", "ckpt.async_save=false", "mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1")


def _rows(out) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


def test_one_worker_at_staleness_zero_is_synchronous_training(tmp_path):
    steps = 4
    cfg = tiny_config(*ASYNC, f"train.steps={steps}", "ckpt.every=0")
    summary = run_in_process(cfg, tmp_path / "async", workers=1)
    assert summary["staleness_histogram"] == {"0": steps} and summary["dropped"] == 0
    got = [r["loss"] for r in _rows(tmp_path / "async")]
    setup = build(cfg, jax.devices()[:1])            # the synchronous step, the same device
    state, batches = setup.init_state(), make_batches(cfg.data)[0]
    want = []
    for i in range(steps):
        state, m = setup.train_step(state, batches.device_batch(i, setup.batch_shardings()))
        want.append(float(m["loss"]))
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert got[-1] < got[0]


def test_one_local_worker_with_outer_lr_1_is_synchronous_training(tmp_path):
    """ps.mode=local: the change of H local steps, added at outer_lr 1, is the local run; with one
    worker that is synchronous training with the worker's own (persistent) optimizer."""
    pushes, H = 3, 2
    cfg = tiny_config(*ASYNC, f"train.steps={pushes}", "ckpt.every=0", "ps.mode=local",
                      f"ps.local_steps={H}")
    run_in_process(cfg, tmp_path / "local", workers=1)
    got = [r["loss"] for r in _rows(tmp_path / "local")]
    setup = build(cfg, jax.devices()[:1])
    state, batches = setup.init_state(), make_batches(cfg.data)[0]
    want = []
    for i in range(pushes * H):
        state, m = setup.train_step(state, batches.device_batch(i, setup.batch_shardings()))
        want.append(float(m["loss"]))
    np.testing.assert_allclose(got, np.mean(np.reshape(want, (pushes, H)), axis=1), rtol=2e-6)


def test_equal_workers_are_n_minus_1_stale_and_a_slow_one_does_not_hold_them(tmp_path):
    """Equal workers: each step stretched 6x by a sleep (`ps.slow`), which releases the
    interpreter as separate processes would overlap, so that the threads of `run_in_process`
    interleave their pushes however loaded the machine is (without it the threads serialise
    some pushes: a mean of 1.5-2.2 measured, against 2.4-2.6 with it on a loaded machine)."""
    n, steps = 4, 24
    same = "ps.slow=" + ",".join(f"{w}:6" for w in range(n))
    equal = run_in_process(tiny_config(*ASYNC, f"train.steps={steps}", "ckpt.every=0", same),
                           tmp_path / "equal", workers=n)
    assert equal["applied"] == steps and abs(equal["mean_staleness"] - (n - 1)) <= 1.0, equal
    slow = run_in_process(tiny_config(*ASYNC, f"train.steps={steps}", "ckpt.every=0",
                                      "ps.slow=2:4", "ps.step_rule=staleness"),
                          tmp_path / "slow", workers=3)
    assert slow["applied"] == steps and slow["dropped"] == 0
    rows = _rows(tmp_path / "slow")
    by = {w: [r for r in rows if r["worker"] == w] for w in range(3)}
    fast = min(len(by[0]), len(by[1]))
    assert len(by[2]) * 2 < fast, {w: len(v) for w, v in by.items()}   # the others go on
    late = np.mean([r["staleness"] for r in by[2]])
    assert late > 2 * np.mean([r["staleness"] for r in by[0] + by[1]])
    for r in rows:                                          # weighted as configured
        assert r["scale"] == pytest.approx(1 / (1 + r["staleness"]))


def test_a_killed_worker_rejoins_and_a_killed_server_resumes(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps")
    env = subprocess_env(tmp_path_factory)
    argv = [sys.executable, "-m", "jaxscale.cli", "launch", "--async", "2", "--", "train",
            "llama_tiny", "--steps", "30", "--out", str(out), *SMALL_ARGS,
            "--set", "ckpt.every=10", "--set", "ckpt.async_save=false"]
    log = out.parent / (out.name + ".err")
    with open(log, "w") as err:
        p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)

        def wait_rows(k):
            deadline = time.monotonic() + 240
            while not (out / "metrics.jsonl").exists() or len(_rows(out)) < k:
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
        wait_rows(4)
        pids = re.search(r"server pid (\d+) .* pids (\d+) (\d+)", log.read_text()).groups()
        os.kill(int(pids[2]), signal.SIGKILL)                   # worker 1
        wait_rows(12)                                           # the server went on
        os.kill(int(pids[0]), signal.SIGKILL)                   # then the server
        assert p.wait(120) != 0
    text = log.read_text()
    assert re.search(r"worker 1 exited with status -9; restarted .* rejoins", text), text[-3000:]
    assert "the server exited with status -9" in text and "--resume" in text
    r = subprocess.run(argv + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out)
    assert [x["step"] for x in rows] == list(range(1, 31))     # from the checkpoint on
    assert {x["worker"] for x in rows[12:]} == {0, 1}
    meta = json.loads((out / "checkpoints" / "30" / "meta" / "metadata").read_text())
    positions = meta["ps"]["positions"]
    assert sum(positions.values()) == 30                        # each batch applied once


def test_bad_input_is_refused_before_anything_starts(capsys, tmp_path):
    cmd = ["train", "llama_tiny", "--out", str(tmp_path / "x"), *SMALL_ARGS]
    assert cli_main(["launch", "--async", "0", "--", *cmd]) == 2
    assert cli_main(["launch", "--async", "2", "--", *cmd, "--set", "ps.max_staleness=-1"]) == 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        assert cli_main(["launch", "--async", "2", "--port", str(taken), "--", *cmd]) == 2
    err = capsys.readouterr().err
    assert "--async needs a worker count >= 1, got 0" in err
    assert "ps.max_staleness=-1: must be an integer >= 0" in err
    assert f"--port {taken} is not free" in err
    assert not (tmp_path / "x").exists()


def test_barrier_rounds_are_synchronous_data_parallelism(tmp_path):
    """ps.barrier: two workers' pushes of one round averaged (by tokens) and applied once: the
    synchronous step over their two batches."""
    steps = 3
    cfg = tiny_config(*ASYNC, f"train.steps={steps}", "ckpt.every=0", "ps.barrier=true")
    summary = run_in_process(cfg, tmp_path / "sync", workers=2)
    assert summary["staleness_histogram"] == {"0": steps}
    got = [r["loss"] for r in _rows(tmp_path / "sync")]
    setup = build(cfg, jax.devices()[:1])
    state, batches = setup.init_state(), make_batches(cfg.data)[0]
    sh, want = setup.batch_shardings(), []
    for i in range(steps):      # one step over batches 2i and 2i + 1 (the two workers' rows)
        both = [batches.device_batch(2 * i + w, sh) for w in range(2)]
        batch = {k: jax.device_put(np.concatenate([np.asarray(b[k]) for b in both]), sh[k])
                 for k in both[0]}
        state, m = setup.train_step(state, batch)
        want.append(float(m["loss"]))
    np.testing.assert_allclose(got, want, rtol=2e-6)
