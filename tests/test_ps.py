"""Asynchronous training through the parameter server (`jaxscale.ps`): one worker at staleness 0
is synchronous training; with the pushes in a given order (`jaxscale.ps.scheduled`: the same
server and workers, the interleaving chosen rather than left to the machine's load) N equal
workers pushing in turn are exactly N - 1 updates late and compute on what they pulled, and a
slow worker's pushes are staler and weighted by their staleness; a killed worker rejoins, a
killed server resumes from its checkpoint; bad input is refused before anything starts. How
real workers interleave is measured by `benchmarks/ps_staleness.py`."""
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
from jaxscale.ps.scheduled import run_scheduled
from jaxscale.ps.supervisor import run_in_process
from jaxscale.train.metrics import read_metrics
from jaxscale.train.setup import build
from tests.helpers import SMALL_ARGS, subprocess_env

ASYNC = ("train.eval_every=0", "ckpt.async_save=false", "mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1")
ONE = jax.devices()[:1]         # scheduled runs: one thread, so the workers share one device


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


def _losses_at(cfg, params, indices) -> list[float]:
    """The loss of `params` on the run's batches `indices` (the workers' gradient program)."""
    setup = build(cfg, jax.devices()[:1])
    batches, grads = make_batches(cfg.data)[0], setup.jit_grads()
    return [float(grads(params, batches.device_batch(i, setup.batch_shardings()))[1])
            for i in indices]


def test_equal_workers_in_turn_are_n_minus_1_stale_and_compute_on_what_they_pulled(tmp_path):
    """Four workers pushing in turn: worker w's first push is w updates late, every later one
    n - 1 = 3; each gradient is taken at the parameters the worker pulled, not the server's
    current ones (the first four at the initial parameters, the fifth after one update)."""
    n, steps = 4, 8
    cfg = tiny_config(*ASYNC, f"train.steps={steps}", "ckpt.every=0")
    summary = run_scheduled(cfg, tmp_path / "equal", n, order=[0, 1, 2, 3] * 2, devices=ONE)
    rows = _rows(tmp_path / "equal")
    assert [r["worker"] for r in rows] == [0, 1, 2, 3] * 2
    assert [r["staleness"] for r in rows] == [0, 1, 2, 3, 3, 3, 3, 3]
    assert summary["staleness_histogram"] == {"0": 1, "1": 1, "2": 1, "3": 5}
    assert summary["pushes_by_worker"] == {str(w): 2 for w in range(n)}
    assert all(r["scale"] == 1.0 for r in rows)                 # ps.step_rule=constant
    setup = build(cfg, jax.devices()[:1])
    state0 = setup.init_state()
    want = _losses_at(cfg, state0.params, range(n))             # worker w: batch w at step 0
    state1, _ = setup.train_step(state0, make_batches(cfg.data)[0].device_batch(
        0, setup.batch_shardings()))                            # push 1: a synchronous step
    want += _losses_at(cfg, state1.params, [n])                 # worker 0's second: batch 4
    np.testing.assert_allclose([r["loss"] for r in rows[:n + 1]], want, rtol=2e-6)
    meta = json.loads((tmp_path / "equal" / "checkpoints" / str(steps) / "meta" / "metadata")
                      .read_text())
    assert meta["ps"]["positions"] == {str(w): 2 for w in range(n)}   # each batch once


def test_a_slow_worker_is_staler_and_its_pushes_are_weighted_by_staleness(tmp_path):
    """Worker 2 pushes once for every 8 pushes of workers 0 and 1 (four each): its pushes are
    8 updates late, theirs 1 (2 just after its push), and `ps.step_rule=staleness` scales each
    update by 1 / (1 + staleness). The same order under the constant rule gives the same
    losses until a push computed on parameters that a scaled update changed (the fourth)."""
    steps, order = 12, ([0, 1] * 4 + [2]) * 2
    cfg = tiny_config(*ASYNC, f"train.steps={steps}", "ckpt.every=0", "ps.step_rule=staleness")
    summary = run_scheduled(cfg, tmp_path / "slow", 3, order=order, devices=ONE)
    rows = _rows(tmp_path / "slow")
    assert [r["worker"] for r in rows] == order[:steps]
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1, 1, 1, 1, 1, 8, 2, 2, 1]
    assert summary["pushes_by_worker"] == {"0": 6, "1": 5, "2": 1}
    assert summary["applied"] == steps and summary["dropped"] == 0
    assert [r["scale"] for r in rows] == [1 / (1 + r["staleness"]) for r in rows]
    run_scheduled(tiny_config(*ASYNC, f"train.steps={steps}", "ckpt.every=0"),
                  tmp_path / "constant", 3, order=order, devices=ONE)
    plain = [r["loss"] for r in _rows(tmp_path / "constant")]
    weighted = [r["loss"] for r in rows]
    assert weighted[:3] == plain[:3]          # pulled before the first scaled update (push 2)
    assert weighted[3] != plain[3]            # worker 1 pulled after it


def test_a_scheduled_order_that_ends_early_or_names_no_worker_is_refused(tmp_path):
    cfg = tiny_config(*ASYNC, "train.steps=3", "ckpt.every=0")
    with pytest.raises(ValueError, match="the order ended after 2 of 3 updates"):
        run_scheduled(cfg, tmp_path / "short", 2, order=[0, 1])
    with pytest.raises(ValueError, match="order names worker 2; the workers are 0..1"):
        run_scheduled(cfg, tmp_path / "none", 2, order=[0, 2])
    with pytest.raises(ValueError, match="ps.barrier"):
        run_scheduled(tiny_config(*ASYNC, "ps.barrier=true"), tmp_path / "sync", 2, order=[0])


def test_a_killed_worker_rejoins_and_a_killed_server_resumes(tmp_path_factory):
    """Worker 0 is stopped (SIGSTOP) and worker 1 killed: until the restarted worker 1 pushes,
    the server can apply nothing but the one request each had in flight, so the restarted
    worker's pushes are seen whatever the processes' speeds. The first command asks for 1000
    steps, so the server is killed in the middle of the run however slowly this test follows
    it; the same command with --resume (and the number of steps it is to end at) continues from
    the last checkpoint, each worker from its own data position."""
    out = tmp_path_factory.mktemp("ps")
    env = subprocess_env(tmp_path_factory)

    def argv(steps):
        return [sys.executable, "-m", "jaxscale.cli", "launch", "--async", "2", "--", "train",
                "llama_tiny", "--steps", str(steps), "--out", str(out), *SMALL_ARGS,
                "--set", "ckpt.every=10", "--set", "ckpt.async_save=false"]
    log = out.parent / (out.name + ".err")
    with open(log, "w") as err:
        p = subprocess.Popen(argv(1000), env=env, stdout=subprocess.DEVNULL, stderr=err)

        def wait_until(done, what):                 # a guard against a hang, not a bound
            deadline = time.monotonic() + 300
            while not done():
                assert p.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, f"no {what}: " + log.read_text()[-3000:]
                time.sleep(0.05)

        def rows(worker=None):
            got = _rows(out) if (out / "metrics.jsonl").exists() else []
            return [r for r in got if worker is None or r["worker"] == worker]
        wait_until(lambda: len(rows()) >= 4, "4 updates")
        pids = re.search(r"server pid (\d+) .* pids (\d+) (\d+)", log.read_text()).groups()
        server, worker0, worker1 = (int(x) for x in pids)
        os.kill(worker0, signal.SIGSTOP)
        before = len(rows(1)) + 1                   # + the push it may have had in flight
        os.kill(worker1, signal.SIGKILL)
        wait_until(lambda: len(rows(1)) > before, "push of the restarted worker 1")
        wait_until(lambda: len(rows()) >= 12, "12 updates")      # past the checkpoint at 10
        os.kill(server, signal.SIGKILL)
        assert p.wait(120) != 0
    text = log.read_text()
    assert re.search(r"worker 1 exited with status -9; restarted .* rejoins", text), text[-3000:]
    assert "the server exited with status -9" in text and "--resume" in text
    last = json.loads((out / "checkpoints" / str(max(
        int(d.name) for d in (out / "checkpoints").iterdir() if d.name.isdigit())) / "meta" /
        "metadata").read_text())
    at, end = last["step"], last["step"] + 6
    r = subprocess.run(argv(end) + ["--resume"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in _rows(out)] == list(range(1, end + 1))   # from the checkpoint on
    meta = json.loads((out / "checkpoints" / str(end) / "meta" / "metadata").read_text())
    positions, kept = ({int(w): n for w, n in m["ps"]["positions"].items()} for m in (meta, last))
    assert sum(positions.values()) == end and sum(kept.values()) == at >= 10   # each batch once
    assert all(positions[w] >= kept[w] for w in (0, 1))        # each from its own position


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
