"""Supervised runs: the in-process monitor (heartbeats, the hang watchdog and its exit status, a
lost peer, the straggler report over a real `process_allgather`), the launcher's restarts, hang
detection with stack dumps and elastic mesh choice, tested on small fake training programs (the
elastic restart then runs the real `jaxscale train`; the end-to-end restart of a real
two-process run is in tests/test_multiprocess.py). No assertion waits on the clock: a hang is
a clock moved by an hour, and the fake processes meet before they hang."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from jaxscale import config as config_lib
from jaxscale.launch import Run, launch
from jaxscale.launch.elastic import choose_mesh
from jaxscale.train import supervise


def train_cfg(**kw):
    base = dict(straggler_every=0, straggler_factor=1.5, hang_factor=10.0, hang_min_s=300.0)
    return SimpleNamespace(**{**base, **kw})


# ----------------------------------------------------------------------------- the monitor
def test_hang_limit_floor_median_and_first_step():
    assert supervise.hang_limit(None, False, 10, 300) == supervise.STARTUP_FACTOR * 300
    assert supervise.hang_limit(None, True, 10, 300) == 300
    assert supervise.hang_limit(2.0, True, 10, 300) == 300
    assert supervise.hang_limit(40.0, True, 10, 300) == 400


def test_heartbeat_and_straggler_report_from_mean_step_times(tmp_path, capsys):
    sent = []

    def gather(x):                     # three processes: process 1 three times slower
        sent.append(x)
        return [x, 3 * x, 1.1 * x]
    mon = supervise.Monitor(train_cfg(straggler_every=3), tmp_path, 0, process=0, processes=3,
                            gather=gather, supervisor="launch")
    assert mon.stepped(1, 9.0) == {}                   # compilation: not a step time
    assert mon.stepped(2, 0.1) == {}
    row = mon.stepped(3, 0.3)
    assert sent == [pytest.approx(0.2)]                # the mean since the start, step 1 left out
    assert row["step_time_by_process"] == pytest.approx([0.2, 0.6, 0.22])
    assert row["straggler"] == {"1": pytest.approx(0.6)}
    assert "straggler at step 3: process 1" in capsys.readouterr().err
    for s, t in ((4, 0.2), (5, 0.2)):
        assert mon.stepped(s, t) == {}
    assert "straggler" in mon.stepped(6, 0.2) and sent[-1] == pytest.approx(0.2)
    mon.close()
    hb = supervise.read_heartbeats(tmp_path)[0]
    assert hb["step"] == 6 and hb["closed"] and hb["pid"] == os.getpid()
    assert hb["median_s"] == pytest.approx(0.2) and hb["limit_s"] == 300.0
    one = supervise.Monitor(train_cfg(straggler_every=1), tmp_path, 0, process=0, processes=1,
                            gather=lambda x: pytest.fail("one process gathers nothing"))
    assert one.stepped(1, 1.0) == {} and one.stepped(2, 1.0) == {}
    one.close()


WATCHED = r"""
import sys, time
from pathlib import Path
from types import SimpleNamespace
from jaxscale.train import supervise

def stuck_in_a_collective():
    time.time = lambda now=time.time: now() + 3600   # an hour passes here without a step
    time.sleep(600)

cfg = SimpleNamespace(straggler_every=0, straggler_factor=1.5, hang_factor=10.0, hang_min_s=300)
with supervise.Monitor(cfg, Path(sys.argv[1]), 0, process=0, processes=1, supervisor="") as m:
    for step in range(1, 4):
        m.stepped(step, 0.01)
    if sys.argv[2] == "hang":
        stuck_in_a_collective()
    raise ValueError(sys.argv[3])
"""
GLOO = ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read "
        "error [127.0.0.1]:58257: Connection reset by peer")


def test_watchdog_dumps_its_stack_and_exits_restartable(tmp_path):
    """The hang: the process's clock jumps an hour once it is stuck (the limit is 300 s), so the
    watchdog's next look (within a second) finds it, however slowly the process got there."""
    r = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path), "hang", ""],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == supervise.EXIT_RESTARTABLE == 75, r.stderr
    stacks = supervise.stack_path(tmp_path, 0)
    assert re.search(r"no step completed for 36\d\d\.\d s after step 3 \(limit 300\.0 s", r.stderr)
    assert str(stacks) in r.stderr
    assert "stuck_in_a_collective" in stacks.read_text()


def test_a_lost_peer_exits_restartable_other_errors_do_not(tmp_path):
    assert supervise.peer_lost(ValueError(GLOO)) and not supervise.peer_lost(ValueError("x"))
    r = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path), "fail", GLOO],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == supervise.EXIT_RESTARTABLE, r.stderr
    assert "lost a peer" in r.stderr
    r = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path), "fail", "a bug"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "ValueError: a bug" in r.stderr


# ----------------------------------------------------------------------------- the launcher
#: a training process stand-in: records its attempt, steps 3 times under a Monitor, then does
#: what FAKE_PLAN says for this attempt ("real": the real `jaxscale train` of the command). A
#: process that kills itself first waits until every process has recorded this attempt, so that
#: no peer is killed by the launcher before its record is written, whatever the load. Its
#: hang limit (300 s) is never reached by the clock: a "hang" waits until every process has
#: done its 3 steps, then sets its clock an hour back and reports step 3 again, so that the
#: launcher's next look at the heartbeats finds it, whatever the machine's load
FAKE = r"""
import json, os, signal, sys, time
from pathlib import Path
from types import SimpleNamespace
from jaxscale.train import supervise

def wait_for(*paths):   # a barrier: how long it takes is never looked at (the pause spares CPU)
    while not all(p.exists() for p in paths):
        time.sleep(0.01)

def stuck_in_a_collective(mon=None):
    if mon is not None:
        (out / f"stepped-{i}").touch()
        wait_for(*(out / f"stepped-{j}" for j in range(n)))
        time.time = lambda now=time.time: now() - 3600
        mon.stepped(3, 0.02)
    time.sleep(600)

argv = sys.argv[1:]
out = Path(argv[argv.index("--out") + 1])
i, n = int(os.environ["JAXSCALE_PROCESS_ID"]), int(os.environ["JAXSCALE_NUM_PROCESSES"])
supervise.register_stack_dump(os.environ["JAXSCALE_STACK_FILE"])
log = out / f"attempts-{i}.jsonl"
attempt = len(log.read_text().splitlines()) if log.exists() else 0
with open(log, "a") as f:
    f.write(json.dumps({"n": n, "argv": argv, "port": os.environ["JAXSCALE_COORDINATOR"]}) + "\n")
(out / f"started-{attempt}-{i}").touch()
what = json.loads(os.environ["FAKE_PLAN"])[attempt]
if what == "refused":
    sys.exit(2)
if what == "real":
    from jaxscale.cli import main
    sys.exit(main(argv))
cfg = SimpleNamespace(straggler_every=0, straggler_factor=1.5, hang_factor=10.0, hang_min_s=300)
mon = supervise.Monitor(cfg, out, 0, process=i, processes=n)
for step in range(1, 4):
    mon.stepped(step, 0.02)
ckpt = out / "checkpoints" / "3"
if what == "ckpt" and i == 0:
    ckpt.mkdir(parents=True)
if what in ("die", "ckpt") and i == n - 1:
    wait_for(*(out / f"started-{attempt}-{j}" for j in range(n)), *[ckpt] * (what == "ckpt"))
    os.kill(os.getpid(), signal.SIGKILL)
if what in ("die", "ckpt", "hang"):
    stuck_in_a_collective(mon if what == "hang" else None)
mon.close()
"""


def fake_launch(tmp_path, monkeypatch, plan, processes=2, cfg=None, command=None, **kw):
    monkeypatch.setenv("FAKE_PLAN", json.dumps(plan))
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    run = Run(out, out / "checkpoints", cfg, hang_min_s=300.0)
    rc = launch(command or ["train", "fake", "--out", str(out)], processes=processes,
                local_devices=4, run=run, program=[sys.executable, "-c", FAKE], **kw)
    attempts = [[json.loads(x) for x in (out / f"attempts-{i}.jsonl").read_text().splitlines()]
                for i in range(processes) if (out / f"attempts-{i}.jsonl").exists()]
    return rc, out, attempts


def test_a_dead_process_restarts_from_the_checkpoint_on_a_fresh_port(tmp_path, monkeypatch,
                                                                    capfd):
    rc, out, attempts = fake_launch(tmp_path, monkeypatch, ["ckpt", "ok"], max_restarts=2)
    err = capfd.readouterr().err
    assert rc == 0, err
    first, second = attempts[0]
    assert "--resume" not in first["argv"] and second["argv"][-1] == "--resume"
    assert first["port"] != second["port"]
    assert re.search(r"restart 1 of 2 after process 1 \(pid \d+\) was killed by SIGKILL; "
                     r"resuming from checkpoint step 3", err), err


def test_without_a_checkpoint_it_starts_again_then_gives_up(tmp_path, monkeypatch, capfd):
    rc, out, attempts = fake_launch(tmp_path, monkeypatch, ["die", "die"], max_restarts=1)
    err = capfd.readouterr().err
    assert rc == 128 + signal.SIGKILL, err
    assert [a["argv"] for a in attempts[0]] == [["train", "fake", "--out", str(out)]] * 2
    assert "restart 1 of 1 after process 1" in err and "starting from scratch" in err
    assert "giving up after 1 restart(s) (--max-restarts 1)" in err


def test_a_refused_command_is_not_restarted(tmp_path, monkeypatch, capfd):
    rc, out, attempts = fake_launch(tmp_path, monkeypatch, ["refused", "ok"], max_restarts=3)
    assert rc == 2 and len(attempts[0]) == 1
    assert "not restarted, as the command was refused" in capfd.readouterr().err


def test_a_hang_dumps_every_stack_then_restarts(tmp_path, monkeypatch, capfd):
    rc, out, attempts = fake_launch(tmp_path, monkeypatch, ["hang", "ok"], max_restarts=1)
    err = capfd.readouterr().err
    assert rc == 0, err
    files = [supervise.stack_path(out, i) for i in range(2)]
    assert re.search(r"a hang: process \d completed no step for 36\d\d\.\d s after step 3 "
                     r"\(limit 300\.0 s", err), err
    assert all(str(f) in err for f in files) and "restart 1 of 1 after a hang" in err
    for f in files:
        text = f.read_text()
        assert "jaxscale launch: a hang" in text and "stuck_in_a_collective" in text


def small_llama(*overrides):
    cfg = config_lib.load_experiment("llama_tiny")
    return config_lib.apply_overrides(cfg, ["model.n_layers=2", "data.seq_len=32",
                                            "data.batch_size=8", *overrides])


def test_elastic_restarts_on_one_process_fewer_on_the_nearest_mesh(tmp_path, monkeypatch, capfd):
    """A run of 2 processes x 4 devices (dp2 x fsdp2 x tp2) loses a process after its
    checkpoint at step 2; the restart is the real `jaxscale train --resume` on the one process
    left, on the nearest mesh that fits its 4 devices (fsdp2 x tp2): it restores step 2 there
    and trains steps 3 and 4 to the losses of the uninterrupted run on 8 devices (another mesh:
    another order of reductions, hence the tolerance)."""
    from jaxscale.train.loop import train
    from jaxscale.train.metrics import read_metrics
    from tests.helpers import SMALL_ARGS
    out = tmp_path / "run"
    command = ["train", "llama_tiny", "--steps", "4", "--out", str(out), *SMALL_ARGS,
               "--set", "ckpt.every=2"]
    cfg = config_lib.apply_overrides(config_lib.load_experiment("llama_tiny"),
                                     [a for a in command[6:] if a != "--set"] + ["train.steps=4"])
    train(cfg, out, progress=False)              # the uninterrupted run, here on 8 devices
    ref = read_metrics(out / "metrics.jsonl")
    shutil.rmtree(out / "checkpoints" / "4")     # as if lost after the checkpoint at step 2
    capfd.readouterr()
    rc, out, attempts = fake_launch(tmp_path, monkeypatch, ["die", "real"], cfg=cfg,
                                    command=command, max_restarts=1, elastic=True)
    err = capfd.readouterr().err
    assert rc == 0, err
    assert [a["n"] for a in attempts[0]] == [2, 1] and len(attempts[1]) == 1
    assert attempts[0][1]["argv"][-3:] == ["--resume", "--set", "mesh.dp=1"]
    assert "the nearest that does: fsdp=2 x tp=2 (--set mesh.dp=1)" in err
    assert f"resumed from {out / 'checkpoints' / '2'} (step 2" in err
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in rows[2:]], [r["loss"] for r in ref[2:]],
                               rtol=1e-5)
    metas = [json.loads((out / "checkpoints" / str(k) / "meta" / "metadata").read_text())
             for k in (2, 4)]
    assert [m["mesh"]["devices"] for m in metas] == [8, 4]
    assert metas[1]["mesh"]["degrees"]["dp"] == 1
    params = [{k: v for k, v in m["checksums"].items() if k.startswith("params/")} for m in metas]
    assert params[0] and all(params[1][k] != v for k, v in params[0].items())   # trained on


def test_elastic_stops_when_the_batch_does_not_divide(tmp_path, monkeypatch, capfd):
    rc, out, attempts = fake_launch(tmp_path, monkeypatch, ["die", "ok"], processes=3,
                                    cfg=small_llama("data.batch_size=9"), max_restarts=1,
                                    elastic=True)
    assert rc == 128 + signal.SIGKILL and len(attempts[0]) == 1
    assert "data.batch_size=9 does not divide among 2 processes" in capfd.readouterr().err


def test_elastic_mesh_choice():
    was = {"dp": 2, "fsdp": 2, "tp": 2}
    same = choose_mesh(small_llama("mesh.dp=-1"), 4, 1, 8, 2)
    assert same.same and same.overrides == [] and same.degrees["dp"] == 1
    hybrid = choose_mesh(small_llama("mesh.dp=-1", "mesh.dcn_dp=2"), 4, 1, 8, 2)
    assert hybrid.same and hybrid.overrides == ["mesh.dcn_dp=1"]
    near = choose_mesh(small_llama(), 4, 1, 8, 2)
    assert not near.same and near.overrides == ["mesh.dp=1"]
    assert "nearest that does: fsdp=2 x tp=2" in near.describe(was)
    with pytest.raises(ValueError, match="no mesh for 6 devices fits"):
        choose_mesh(small_llama(), 6, 3, 8, 2)         # batch 8, 8 heads: nothing divides by 3


#: two real JAX processes, one CPU device each; process 1 reports slower steps
GATHERED = r"""
import json, os, sys
from pathlib import Path
from types import SimpleNamespace
from jaxscale.launch import initialize_from_env
initialize_from_env()
import jax
from jaxscale.train import supervise
out = Path(sys.argv[sys.argv.index("--out") + 1])
cfg = SimpleNamespace(straggler_every=2, straggler_factor=1.5, hang_factor=10.0, hang_min_s=60.0)
rows = []
with supervise.Monitor(cfg, out, 0) as mon:
    for step in range(1, 5):
        rows.append(mon.stepped(step, 0.1 * (1 + 2 * jax.process_index())))
(out / f"rows-{jax.process_index()}.json").write_text(json.dumps(rows))
"""


def test_straggler_report_over_process_allgather(tmp_path, capfd):
    out = tmp_path / "run"
    out.mkdir()
    rc = launch(["train", "gathered", "--out", str(out)], processes=2, local_devices=1,
                run=Run(out, out / "checkpoints", None, 60.0),
                program=[sys.executable, "-c", GATHERED])
    err = capfd.readouterr().err
    assert rc == 0, err
    rows = [json.loads((out / f"rows-{i}.json").read_text()) for i in range(2)]
    assert rows[0] == rows[1]
    assert rows[0][0] == {} and rows[0][2] == {}
    for row in (rows[0][1], rows[0][3]):
        assert row["step_time_by_process"] == pytest.approx([0.1, 0.3])
        assert row["straggler"] == {"1": pytest.approx(0.3)}
    assert err.count("straggler at step") == 2 and "[process 1] jaxscale train: straggler" \
        not in err                                     # named by process 0 only


#: two real JAX processes without the launcher; process 1 dies between two collectives
PEER = r"""
import os, signal, sys
from pathlib import Path
from types import SimpleNamespace
from jaxscale.launch import initialize_from_env
initialize_from_env()
import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxscale.train import supervise
cfg = SimpleNamespace(straggler_every=0, straggler_factor=1.5, hang_factor=10.0, hang_min_s=60.0)
with supervise.Monitor(cfg, Path(sys.argv[1]), 0) as mon:
    for step in range(1, 1000):
        multihost_utils.process_allgather(np.float32(step))
        mon.stepped(step, 0.01)
        if step == 5 and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_real_lost_peer_exits_restartable_at_once(tmp_path):
    """Process 0 leaves with status 75 on gloo's error, not on the coordination service's
    heartbeat timeout: that is an hour here, twelve times the longest this test waits."""
    from jaxscale.launch import _child_env, free_port
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", PEER, str(tmp_path)],
                              env=_child_env(i, 2, port, 1, heartbeat=3600, prefix=""),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        err = procs[0].communicate(timeout=300)[1]     # a guard against a hang, not a bound
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == supervise.EXIT_RESTARTABLE, err[-3000:]
    assert "process 0 lost a peer" in err
