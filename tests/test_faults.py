"""Faults a run meets on the way: a checkpoint directory that fills up or turns read-only while
the run goes, and a checkpoint whose recorded position is malformed. Each ends in a short error
without a traceback that names the directory, the cause and what is kept; a write fault exits
with the restartable status and never hangs, a malformed checkpoint changes nothing on disk.

The write faults are real: the checkpoint directory lives on a small tmpfs mounted in a private
mount namespace (`tests/fault_mount.py`, a user namespace: no root needed). Training runs are
subprocesses of `python -m jaxscale.cli train llama_tiny` on a tiny model sharing one
persistent compilation cache.
"""
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxscale.cli import main
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train.supervise import EXIT_RESTARTABLE
from tests import fault_mount
from tests.helpers import SMALL_ARGS, subprocess_env

DRIVER = Path(fault_mount.__file__)
TRIES = 3                   # read-only runs: an exit left to the interpreter hung in ~half


def train_argv(out, steps, *extra) -> list[str]:
    return [sys.executable, "-m", "jaxscale.cli", "train", "llama_tiny", "--steps", str(steps),
            "--out", str(out), *SMALL_ARGS, *extra]


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def snapshot(root: Path) -> dict:
    """Every path under `root` with its file's SHA-256 (None for a directory)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return subprocess_env(tmp_path_factory)


@pytest.fixture(scope="module")
def prefix():
    return fault_mount.namespace_prefix()       # raises (fails the test) when it cannot


def faulted_run(tmp: Path, env, prefix, size: str, steps: int, readonly_after: int | None):
    """A run whose checkpoint directory is a `size` tmpfs (turned read-only once the checkpoint
    of step `readonly_after` is finalized): (its result, its stderr, a copy of the checkpoint
    directory as the run left it, the run directory)."""
    mnt, out, kept = tmp / "mnt", tmp / "run", tmp / "kept"
    spec = {"mount": str(mnt), "size": size, "log": str(tmp / "stderr"), "timeout": 240,
            "argv": train_argv(out, steps, "--set", "ckpt.every=2",
                               "--set", f"ckpt.dir={mnt / 'ck'}"),
            "readonly_when": str(mnt / "ck" / str(readonly_after)) if readonly_after else None,
            "copy": [[str(mnt / "ck"), str(kept)]]}
    r = subprocess.run(prefix + [sys.executable, str(DRIVER), json.dumps(spec)], env=env,
                       capture_output=True, text=True, timeout=400)   # a guard: fails the test
    assert r.returncode == 0, f"the fault could not be set up: {r.stderr[-2000:]}"
    result = json.loads(r.stdout.strip().splitlines()[-1])
    return result, (tmp / "stderr").read_text(), kept, out


def assert_clear_write_error(result, err: str, kept: Path, directory: str, cause: str) -> int:
    """The run exited restartable at once with one short message naming the directory, the cause
    and the newest finalized checkpoint (returned), and no traceback."""
    assert not result["hung"], f"the run did not exit: {err[-2000:]}"
    assert result["rc"] == EXIT_RESTARTABLE, err[-3000:]
    intact = ckpt_meta.scan(kept).latest
    assert intact is not None, "no checkpoint was finalized before the fault"
    assert "Traceback" not in err and "ERROR:" not in err, err[-3000:]
    said = [line for line in (part.split("\r")[-1] for part in err.splitlines())
            if line.strip() and not line.startswith("llama_tiny:")]    # the progress bar aside
    assert len(said) == 2 and said[0].startswith("jaxscale train: error: "), said
    assert f"cannot write checkpoint step {intact + 2} to {directory}: {cause}" in err, err
    assert f"The last intact checkpoint is step {intact} ({directory}/{intact})" in err, err
    assert f"exiting with status {EXIT_RESTARTABLE} (restartable)" in err
    return intact


def test_full_checkpoint_directory_is_named_and_the_intact_checkpoint_resumes_exactly(
        tmp_path, env, prefix):
    """12 MiB hold two checkpoints of ~5 MiB: the third save fails. The resume from the named
    checkpoint (copied off the tmpfs, the unfinished save with it) computes the steps after it
    exactly as the failed run did, uninterrupted from step 0."""
    result, err, kept, out = faulted_run(tmp_path, env, prefix, "12m", 10, None)
    directory = str(tmp_path / "mnt" / "ck")
    intact = assert_clear_write_error(result, err, kept, directory, "No space left on device")
    assert "Free space on its file system" in err
    assert ckpt_meta.scan(kept).partial, "the failed save should have left its tmp directory"
    before = {r["step"]: r for r in rows_of(out)}
    assert max(before) > intact
    r = subprocess.run(train_argv(out, max(before), "--set", "ckpt.every=2", "--set",
                                  f"ckpt.dir={kept}", "--resume"),
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not ckpt_meta.scan(kept).partial          # the unfinished save was discarded
    after = {r["step"]: r for r in rows_of(out)}
    for step in range(intact + 1, max(before) + 1):
        for k in ("loss", "grad_norm", "lr"):
            assert after[step][k] == before[step][k], (step, k)


def test_checkpoint_directory_turning_read_only_never_hangs(tmp_path, env, prefix):
    """Made read-only once the step-2 checkpoint is finalized, so the step-4 save fails (in
    flight or at its start, as the timing falls); left to the interpreter's exit, about half
    such runs never exited."""
    for i in range(TRIES):
        tmp = tmp_path / f"try{i}"
        tmp.mkdir()
        result, err, kept, _ = faulted_run(tmp, env, prefix, "64m", 200, 2)
        assert result["readonly"], f"try {i}: the run ended before the fault: {err[-2000:]}"
        assert_clear_write_error(result, err, kept, str(tmp / "mnt" / "ck"),
                                 "Read-only file system")
        assert "Remount its file system read-write" in err


# ----------------------------------------------------------------------------- malformed position
@pytest.fixture(scope="module")
def finished(tmp_path_factory, env):
    """A finished run (checkpoints 2 and 4, its config, metrics, TensorBoard, heartbeat)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    r = subprocess.run(train_argv(out, 4, "--set", "ckpt.every=2"), env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


MALFORMED = {   # meta key -> (a value a hand edit or a buggy writer left, what the error says)
    "data_position": ("4", "data_position is '4' (str), not a non-negative integer"),
    "step": (-4, "step is -4 (int), not a non-negative integer"),
    "data_state": ({"version": 2, "step": "4", "round": [0, 0], "emitted": 0},
                   "data_state.step is '4' (str)"),
    "guards": ({"rollbacks": 0, "window": ["4.2"]}, "guards.window is \"['4.2']\""),
}


@pytest.mark.parametrize("key", MALFORMED)
def test_malformed_position_is_refused_and_the_run_directory_is_unchanged(
        key, finished, tmp_path, capsys):
    """The metadata's digest is made consistent with the edit: only the position's types say
    that it is malformed. Unchecked, the resume rewrote config.json, the heartbeat and
    TensorBoard, then failed at the first batch."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    meta_file = out / "checkpoints" / "4" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta[key] = MALFORMED[key][0]
    meta["digest"] = ckpt_meta._digest(meta)
    meta_file.write_text(json.dumps(meta))
    before = snapshot(out)
    assert main(["train", "llama_tiny", "--steps", "6", "--out", str(out), *SMALL_ARGS,
                 "--set", "ckpt.every=2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert snapshot(out) == before, "a failed resume must leave the run directory as it was"
    assert f"checkpoint {out}/checkpoints/4 is damaged: the position its metadata records is " \
           f"malformed ({MALFORMED[key][1]}" in err, err
    assert "To resume from the previous checkpoint (step 2)" in err
    assert "Traceback" not in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- data prepare
def test_data_prepare_honours_max_bytes_given_with_set(tmp_path, capsys):
    assert main(["data", "prepare", "llama_tiny", "--set", "data.max_bytes=20000",
                 "--out", str(tmp_path / "shards")]) == 0
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["text_bytes"] == 20000
    assert main(["data", "prepare", "llama_tiny", "--set", "data.max_bytes=20000",
                 "--max-bytes", "20000", "--out", str(tmp_path / "again")]) == 0
