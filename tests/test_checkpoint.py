"""Checkpoints and recovery: exact resume after kill -9 (also mid-save), SIGTERM, a second signal,
elastic 8 -> 4 -> 1 restore, the non-finite policy, and the named errors.

Training runs are subprocesses of `python -m jaxscale.cli train llama_tiny` with a tiny model;
they share a persistent compilation cache, so only the first one compiles.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxscale import config as config_lib
from jaxscale.cli import main
from jaxscale.data import Batches, load_corpus
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train import setup as setup_lib
from tests.helpers import SMALL_ARGS, subprocess_env

SMALL = SMALL_ARGS
EXACT = ("loss", "grad_norm", "lr", "skipped")
REF_STEPS = 40


def train_argv(out, steps, *extra) -> list[str]:
    return [sys.executable, "-m", "jaxscale.cli", "train", "llama_tiny", "--steps", str(steps),
            "--out", str(out), *SMALL, *extra]


def start(argv, env, log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, stdout=open(log.with_suffix(".out"), "w"),
                            stderr=open(log.with_suffix(".err"), "w"))


def run(argv, env, timeout=240) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_rows_equal(rows, ref, steps):
    by_step = {r["step"]: r for r in ref}
    for r in rows:
        if r["step"] in steps:
            for k in EXACT:
                assert r[k] == by_step[r["step"]][k], (r["step"], k, r[k], by_step[r["step"]][k])


#: `jaxscale train` whose checkpoint write of step {step} is held (Orbax's background write of
#: the metadata item, after the state's): it creates {marker}, then waits until {release}
#: exists (None: for ever). The save stays in flight, and Orbax's next save waits for it, so
#: the run goes no further than the next checkpoint step until then.
HELD = """
import os, sys, time
from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler
write = handler.JsonCheckpointHandler._save_fn
async def held(self, x, directory):
    if os.path.basename(os.path.dirname(str(directory))).startswith("{step}."):
        open({marker!r}, "w").close()
        while {release!r} is None or not os.path.exists({release!r}):
            time.sleep(0.01)
    return await write(self, x, directory)
handler.JsonCheckpointHandler._save_fn = held
from jaxscale.cli import main
sys.exit(main(sys.argv[1:]))
"""


def held_argv(out, steps, step, marker, release, *extra) -> list[str]:
    script = HELD.format(step=step, marker=str(marker), release=release and str(release))
    return [sys.executable, "-c", script, *train_argv(out, steps, *extra)[3:]]


def wait_for(pred, proc, timeout=180, poll=0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        assert proc.poll() is None, f"training exited early with {proc.returncode}"
        time.sleep(poll)
    raise AssertionError("timed out waiting for the training subprocess")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return subprocess_env(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    """An uninterrupted run: its metrics, and checkpoints at steps 20, 30, 40."""
    out = tmp_path_factory.mktemp("reference")
    run(train_argv(out, REF_STEPS, "--set", "ckpt.every=10"), env)
    rows = rows_of(out)
    assert [r["step"] for r in rows] == list(range(1, REF_STEPS + 1))
    return out, rows


def test_kill9_during_async_save_then_resume_equals_uninterrupted(tmp_path, env, reference):
    """The write of step 6 is held (`HELD`) until the process is killed: the kill lands while
    that save is in flight, whatever the machine's pace."""
    _, ref = reference
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    marker = tmp_path / "saving-6"
    p = start(held_argv(out, REF_STEPS, 6, marker, None, "--set", "ckpt.every=2"), env,
              tmp_path / "killed")
    try:
        wait_for(marker.exists, p, poll=0.02)
    finally:
        p.kill()                                       # SIGKILL while the write is in flight
    assert p.wait(60) == -signal.SIGKILL
    listing = ckpt_meta.scan(ck)
    assert 6 not in listing.complete and listing.partial, listing
    assert any(n.startswith(f"6{ckpt_meta.TMP_MARK}") for n in os.listdir(ck))
    prev = listing.latest
    assert prev == 4
    assert max(r["step"] for r in rows_of(out)) > prev   # rows past the checkpoint get replaced

    r = run(train_argv(out, REF_STEPS, "--resume"), env)
    assert f"resumed from {ck / str(prev)} (step {prev}" in r.stderr
    rows = rows_of(out)
    assert [x["step"] for x in rows] == list(range(1, REF_STEPS + 1))   # each step exactly once
    assert_rows_equal(rows, ref, range(1, REF_STEPS + 1))               # bitwise, both halves
    assert not ckpt_meta.scan(ck).partial                                # leftovers cleaned up


def test_sigterm_saves_the_current_step_exits_0_and_resume_continues(tmp_path, env, reference):
    """The write of step 4 is held until the signal has been received, so the run is between
    steps 4 and 8 (Orbax's save of 8 waits for 4's) when it stops, however slowly this test
    follows it."""
    _, ref = reference
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    marker, release = tmp_path / "saving-4", tmp_path / "release"
    p = start(held_argv(out, 400, 4, marker, release, "--set", "ckpt.every=4"), env,
              tmp_path / "term")
    wait_for(marker.exists, p, poll=0.02)
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in (tmp_path / "term.err").read_text(), p, poll=0.02)
    release.touch()
    assert p.wait(120) == 0
    err = (tmp_path / "term.err").read_text()
    n = int(re.search(r"stopped by SIGTERM after step (\d+) of 400", err).group(1))
    assert "--resume" in err and 4 <= n <= 8
    assert ckpt_meta.scan(ck).latest == n and not ckpt_meta.scan(ck).partial
    assert rows_of(out)[-1]["step"] == n

    r = run(train_argv(out, n + 3, "--resume"), env)
    assert f"resumed from {ck / str(n)}" in r.stderr
    rows = rows_of(out)
    assert [x["step"] for x in rows] == list(range(1, n + 4))
    assert_rows_equal(rows, ref, range(1, n + 4))


def test_second_signal_exits_at_once_and_keeps_finalized_checkpoints(tmp_path, env):
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    p = start(train_argv(out, 400, "--set", "ckpt.every=2"), env, tmp_path / "twice")
    wait_for(lambda: (ck / "4").is_dir(), p, poll=0.02)
    p.send_signal(signal.SIGINT)
    wait_for(lambda: "SIGINT received" in (tmp_path / "twice.err").read_text(), p, poll=0.01)
    p.send_signal(signal.SIGINT)
    assert p.wait(120) == 128 + signal.SIGINT
    assert "second signal" in (tmp_path / "twice.err").read_text()
    # every finalized checkpoint still restores
    cfg = config_lib.apply_overrides(config_lib.load_experiment("llama_tiny"),
                                     [s for s in SMALL if s != "--set"])
    setup = setup_lib.build(cfg)
    ckpt = ckpt_lib.Checkpointer(ck, cfg.ckpt, read_only=True)
    for step in ckpt_meta.scan(ck).complete:
        assert int(ckpt.restore(step, setup.abstract_state()).step) == step


# ----------------------------------------------------------------------------- non-finite
POISON = """
import sys, numpy as np, jax
from jaxscale.train import loop
orig = loop.Batches.device_batch
def device_batch(self, i, shardings):
    batch = orig(self, i, shardings)
    if self.stream == 0 and i == {index}:     # the batch of step {index} + 1: NaN loss weights
        batch["mask"] = jax.device_put(np.full(batch["mask"].shape, np.nan, np.float32),
                                       shardings["mask"])
    return batch
loop.Batches.device_batch = device_batch
from jaxscale.cli import main
sys.exit(main(sys.argv[1:]))
"""


def poisoned_run(out, index, env, *extra):
    argv = [sys.executable, "-c", POISON.format(index=index), *train_argv(out, 4, *extra)[3:]]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)


def test_nonfinite_skip_counts_and_carries_on(tmp_path, env, reference):
    _, ref = reference
    r = poisoned_run(tmp_path, 1, env, "--set", "train.nonfinite=skip", "--set", "ckpt.every=2")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = rows_of(tmp_path)
    assert [x["skipped"] for x in rows] == [0, 1, 0, 0]
    assert np.isnan(rows[1]["loss"]) and all(np.isfinite(x["loss"]) for x in rows[2:])
    assert rows[0]["loss"] == ref[0]["loss"] and rows[2]["loss"] != ref[2]["loss"]
    assert "update skipped" in r.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_steps"] == 1
    assert ckpt_meta.scan(tmp_path / "checkpoints").complete == [2, 4]


def test_nonfinite_stop_keeps_the_last_good_checkpoint(tmp_path, env):
    r = poisoned_run(tmp_path, 2, env, "--set", "train.nonfinite=stop", "--set", "ckpt.every=1")
    assert r.returncode == 3, r.stderr[-2000:]            # EXIT_STOPPED: not restarted
    assert "non-finite loss nan" in r.stderr and "train.nonfinite=stop" in r.stderr
    assert "the last good checkpoint is step 2" in r.stderr and "--resume" in r.stderr
    listing = ckpt_meta.scan(tmp_path / "checkpoints")
    assert listing.complete == [1, 2] and not listing.partial
    last = rows_of(tmp_path)[-1]
    assert last["step"] == 3 and last["skipped"] == 1


# ----------------------------------------------------------------------------- elastic
def _setup_on(n_devices, *mesh):
    cfg = config_lib.apply_overrides(config_lib.load_experiment("llama_tiny"),
                                     [s for s in SMALL if s != "--set"] + list(mesh))
    return setup_lib.build(cfg, jax.devices()[:n_devices])


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _next_loss(setup, state, step):
    corpus = load_corpus(setup.cfg.data)
    b = Batches(corpus.train, setup.cfg.data.batch_size, setup.cfg.data.seq_len,
                setup.cfg.data.seed)
    _, m = setup.train_step(state, b.device_batch(step, setup.batch_shardings()))
    return float(m["loss"])


def test_elastic_restore_8_to_4_to_1_devices(tmp_path, reference):
    ref_out, ref = reference
    src = ref_out / "checkpoints"
    s8 = _setup_on(8)                                        # dp2 x fsdp2 x tp2, as written
    assert s8.placement.mesh_cfg.dp == 2 and s8.placement.mesh_cfg.tp == 2
    params8 = _host(ckpt_lib.Checkpointer(src, s8.cfg.ckpt, read_only=True)
                    .restore(30, s8.abstract_state()).params)

    s4 = _setup_on(4, "mesh.dp=1", "mesh.fsdp=4", "mesh.tp=1")
    state4, meta, _ = _restore(src, s4, 30)
    assert meta["mesh"]["devices"] == 8
    assert state4.params["embed"].sharding.mesh.devices.size == 4
    assert jax.tree.all(jax.tree.map(np.array_equal, _host(state4.params), params8))
    ck4 = ckpt_lib.Checkpointer(tmp_path / "ck4", s4.cfg.ckpt)
    ck4.save(30, state4, ckpt_meta.make_meta(s4.cfg, state4, 30))
    ck4.wait()
    ck4.close()
    np.testing.assert_allclose(_next_loss(s4, state4, 30), ref[30]["loss"], rtol=2e-6)

    s1 = _setup_on(1, "mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1")
    state1, meta, _ = _restore(tmp_path / "ck4", s1, 30)
    assert meta["mesh"]["degrees"]["fsdp"] == 4
    assert jax.tree.all(jax.tree.map(np.array_equal, _host(state1.params), params8))
    np.testing.assert_allclose(_next_loss(s1, state1, 30), ref[30]["loss"], rtol=2e-6)


@pytest.mark.parametrize("context", ["ring", "ulysses"])
def test_restore_onto_context_parallel_mesh(reference, context):
    """A dp x fsdp x tp checkpoint resumes under sequence sharding (sp=2): the same next loss."""
    ref_out, ref = reference
    s = _setup_on(8, "mesh.dp=1", "mesh.fsdp=2", "mesh.sp=2", "mesh.tp=2",
                  f"plan.context={context}")
    state, meta, _ = _restore(ref_out / "checkpoints", s, 30)
    assert meta["mesh"]["degrees"]["sp"] == 1 and s.placement.mesh_cfg.sp == 2
    np.testing.assert_allclose(_next_loss(s, state, 30), ref[30]["loss"], rtol=2e-5)


def _restore(directory, setup, step):
    """Restore `step` onto `setup`'s mesh the way `--resume` does: metadata, checks, arrays."""
    ck = ckpt_lib.Checkpointer(directory, setup.cfg.ckpt, read_only=True)
    meta = ck.read_meta(step)
    notes = ckpt_meta.check_compatible(meta, setup.cfg, setup.abstract_state(), str(directory))
    # the checksums written on one mesh verify the arrays restored onto another
    return ck.restore(step, setup.abstract_state(), meta["checksums"]), meta, notes


# ----------------------------------------------------------------------------- errors
def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*"))} if d.exists() else {}


def _resume_error(out, capsys, *extra) -> str:
    before = _snapshot(out)
    assert main(["train", "llama_tiny", "--steps", "50", "--out", str(out), *SMALL, *extra]) == 2
    assert _snapshot(out) == before, "a failed resume must not change the checkpoint directory"
    return capsys.readouterr().err


@pytest.fixture
def copied(tmp_path, reference):
    """A run directory holding copies of the reference's checkpoints 20 and 30."""
    out = tmp_path / "run"
    for step in (20, 30):
        shutil.copytree(reference[0] / "checkpoints" / str(step), out / "checkpoints" / str(step))
    return out


def test_missing_empty_and_partial_directories(tmp_path, capsys, reference):
    err = _resume_error(tmp_path / "none", capsys, "--resume")
    assert "there is no checkpoint directory" in err and "Drop --resume" in err
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert "is empty" in _resume_error(tmp_path / "empty", capsys, "--resume")
    shutil.copytree(reference[0] / "checkpoints" / "30",
                    tmp_path / "part" / "checkpoints" / f"30{ckpt_meta.TMP_MARK}")
    err = _resume_error(tmp_path / "part", capsys, "--resume")
    assert "only partially written" in err and f"30{ckpt_meta.TMP_MARK}" in err


def _largest_array_file(run: Path, step: int) -> Path:
    return max((run / "checkpoints" / str(step) / "state").rglob("ocdbt.process_0/d/*"),
               key=lambda p: p.stat().st_size)


def test_truncated_checkpoint_names_the_array_the_step_and_the_fallback(copied, capsys):
    data = _largest_array_file(copied, 30)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    err = _resume_error(copied, capsys, "--resume")
    assert re.search(r"checkpoints/30 is damaged: (params|opt_state|master)/[\w/]+: cannot be "
                     r"read in step 30 \(OUT_OF_RANGE", err), err
    assert "pybind" not in err and "TensorStore({" not in err
    assert "newest intact checkpoint (step 20)" in err


def test_flipped_byte_is_a_checksum_mismatch_naming_the_array(copied, capsys):
    """A flipped byte reads back without an error (the files carry no checksums of their own):
    only the checksums in the metadata catch it."""
    data = _largest_array_file(copied, 30)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    err = _resume_error(copied, capsys, "--resume")
    assert re.search(r"checkpoints/30 is damaged: \S+: checksum mismatch in step 30", err), err
    assert "newest intact checkpoint (step 20)" in err


def test_newest_intact_step_skips_damaged_older_ones(copied, capsys, reference):
    """With 40 and 30 both damaged, the message names 20 (verified), not 30."""
    shutil.copytree(reference[0] / "checkpoints" / "40", copied / "checkpoints" / "40")
    for step in (40, 30):
        data = _largest_array_file(copied, step)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 3] ^= 0x01
        data.write_bytes(bytes(raw))
    err = _resume_error(copied, capsys, "--resume")
    assert "checksum mismatch in step 40" in err and "newest intact checkpoint (step 20)" in err


def test_corrupt_edited_or_deleted_metadata_is_named(copied, capsys):
    meta = copied / "checkpoints" / "30" / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    saved["data_position"] += 1                 # valid JSON, wrong content
    meta.write_text(json.dumps(saved))
    err = _resume_error(copied, capsys, "--resume")
    assert "meta/metadata: checksum mismatch in step 30" in err
    meta.write_text("{not json")
    err = _resume_error(copied, capsys, "--resume")
    assert "checkpoints/30 is damaged: its metadata cannot be read" in err
    meta.unlink()
    err = _resume_error(copied, capsys, "--resume")
    assert "checkpoints/30" in err and "metadata" in err


def test_mismatched_model_names_the_parameter(copied, capsys):
    err = _resume_error(copied, capsys, "--resume", "--set", "model.dim=256")
    assert "was written for a different model" in err
    assert "params/embed: shape (320, 128) in the checkpoint, (320, 256) in this run" in err
    assert "model.dim: checkpoint 128, this run 256" in err


def test_new_run_refuses_to_overwrite_checkpoints(copied, capsys):
    err = _resume_error(copied, capsys)
    assert "already holds checkpoints (steps 20, 30)" in err and "--resume" in err
