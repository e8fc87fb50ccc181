"""Two processes x 4 CPU devices through `jaxscale launch` (jax.distributed, gloo collectives):
the loss equals the one-process 8-device run's, checkpoints written by both processes resume,
killing one process stops the other (the launcher kills it, or it leaves on its own lost-peer
error first), and `--max-restarts` restarts them from the last checkpoint to the uninterrupted
run's losses."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxscale.train import checkpoint_meta as ckpt_meta
from tests.helpers import SMALL_ARGS, subprocess_env

SMALL = SMALL_ARGS
STEPS = 30


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return subprocess_env(tmp_path_factory)


def train(out, steps, *extra) -> list[str]:
    return ["train", "llama_tiny", "--steps", str(steps), "--out", str(out), *SMALL,
            "--set", "ckpt.every=3", *extra]


def cli(*argv) -> list[str]:
    return [sys.executable, "-m", "jaxscale.cli", *argv]


def _start_time(pid: int) -> str | None:
    """A process's start time (/proc/<pid>/stat), None once it is gone: with the pid, an
    identity that a later process given the same pid does not share."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_losses_match(rows, ref, steps):
    by_step = {r["step"]: r for r in ref}
    got = {r["step"]: r for r in rows}
    for s in steps:
        # the same program; gloo sums across processes in another order than one process does
        np.testing.assert_allclose(got[s]["loss"], by_step[s]["loss"], rtol=1e-5, err_msg=s)
        np.testing.assert_allclose(got[s]["grad_norm"], by_step[s]["grad_norm"], rtol=1e-4)
        assert got[s]["lr"] == by_step[s]["lr"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    out = tmp_path_factory.mktemp("single")
    r = subprocess.run(cli(*train(out, STEPS)), env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return rows_of(out)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, env):
    out = tmp_path_factory.mktemp("multi")
    r = subprocess.run(cli("launch", "--processes", "2", "--", *train(out, 6)), env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_two_processes_train_and_checkpoint_like_one(two_process_run, reference):
    out, r = two_process_run
    assert "2 processes x 4 CPU devices" in r.stderr
    rows = rows_of(out)
    assert [x["step"] for x in rows] == list(range(1, 7))
    assert_losses_match(rows, reference, range(1, 7))
    listing = ckpt_meta.scan(out / "checkpoints")
    assert listing.complete == [3, 6] and not listing.partial
    meta = json.loads((out / "checkpoints" / "6" / "meta" / "metadata").read_text())
    assert meta["mesh"]["processes"] == 2 and meta["mesh"]["devices"] == 8
    summaries = re.findall(r"^\{\n.*?^\}$", r.stdout, re.S | re.M)   # gloo logs to stdout too
    assert len(summaries) == 1 and json.loads(summaries[0])["steps"] == 6   # process 0's only


def test_resume_then_a_killed_process_stops_the_other_and_the_run_restarts(two_process_run,
                                                                            env, reference,
                                                                            tmp_path):
    out, _ = two_process_run
    err_path = tmp_path / "launch.err"
    p = subprocess.Popen(cli("launch", "--processes", "2", "--max-restarts", "1", "--",
                             *train(out, STEPS), "--resume"),
                         env=env, stdout=subprocess.DEVNULL, stderr=open(err_path, "w"))
    deadline = time.monotonic() + 300            # a guard against a hang, not a bound
    while not (out / "checkpoints" / "9").is_dir():
        assert p.poll() is None, err_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint at step 9"
        time.sleep(0.02)
    pids = [int(x) for x in re.search(r"pids (\d+) (\d+)", err_path.read_text()).groups()]
    started = _start_time(pids[0])
    os.kill(pids[1], signal.SIGSTOP)             # no further step, then the kill
    os.kill(pids[1], signal.SIGKILL)
    assert p.wait(300) == 0, err_path.read_text()[-3000:]
    err = err_path.read_text()
    assert "resumed from" in err and "checkpoints/6 (step 6" in err
    # the other stopped by the launcher, or already gone on its own (its lost-peer exit 75)
    # when the launcher first saw the kill
    stopped = re.search(r"process 1 \(pid \d+\) was killed by SIGKILL; stopped the other "
                        r"([01]) process\(es\) in [\d.]+ s", err)
    assert stopped, err[-3000:]
    assert stopped.group(1) == "1" or "process 0 lost a peer" in err, err[-3000:]
    assert _start_time(pids[0]) != started       # the first process 0 is gone too
    back = re.search(r"restart 1 of 1 after process 1 \(pid \d+\) was killed by SIGKILL; "
                     r"resuming from checkpoint step (\d+)", err)
    assert back and int(back.group(1)) >= 9, err[-3000:]   # finalized checkpoints survive
    rows = rows_of(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert_losses_match(rows, reference, range(7, STEPS + 1))
