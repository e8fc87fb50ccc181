"""Loss spikes (`train.spike_policy`): the detector's window and limits; `skip` discards the update
exactly as the non-finite guard does; `rollback` restores the last checkpoint, skips the batches
since it and goes on bitwise as a run that never saw them; the rollback budget stops the run with
a message; every event reaches metrics.jsonl, the summary and the checkpoint."""
import json
import math
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxscale.analysis.validation import tiny_config
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train import loop
from jaxscale.train.metrics import read_metrics
from jaxscale.train.spikes import SpikeDetector

SPIKE = 10                  # the batch whose targets are scrambled: step 11's loss spikes
BASE = ("train.steps=14", "ckpt.every=4", "ckpt.async_save=false", "train.spike_window=4",
        "mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", "optim.lr=3e-3")


def _detector(method="zscore", threshold=3.0, window=4, history=()):
    return SpikeDetector(SimpleNamespace(spike_window=window, spike_method=method,
                                         spike_threshold=threshold), history)


def test_the_window_and_its_limits():
    d = _detector()
    for x in (4.0, 3.0, 2.0):
        d.accept(x)
        assert d.limit() == math.inf                     # not full yet: nothing is a spike
    d.accept(3.0)
    std = math.sqrt(0.5)
    assert d.limit() == pytest.approx(3.0 + 3 * std)
    d.accept(float("nan"))                               # never enters the window
    assert d.state() == [4.0, 3.0, 2.0, 3.0]
    flat = _detector(history=[2.0] * 4)                  # a flat window: std floored
    assert flat.limit() == pytest.approx(2.0 * (1 + 3e-3))
    assert _detector("ratio", 1.5, history=[2.0, 4.0, 2.0, 4.0]).limit() == pytest.approx(4.5)
    assert "above the limit" in _detector(history=[1.0] * 4).describe(9.0)


class Injected:
    """Training batches with batch SPIKE's targets scrambled (a finite loss spike), and a map of
    batch indices (`skip`: the batches a run never sees)."""

    def __init__(self, inner, poison=(SPIKE,), nan=(), skip=()):
        self.inner, self.poison, self.nan, self.skip = inner, set(poison), set(nan), skip

    def device_batch(self, i, shardings):
        j = i + len(self.skip) if self.skip and i >= self.skip[0] else i
        batch = self.inner.device_batch(j, shardings)
        if j in self.poison:
            rng = np.random.default_rng(j)
            batch["targets"] = jax.device_put(rng.integers(0, 256, batch["targets"].shape,
                                                           dtype=np.int32), shardings["targets"])
        if j in self.nan:
            batch["mask"] = jax.device_put(np.full(batch["mask"].shape, np.nan, np.float32),
                                           shardings["mask"])
        return batch


def _run(tmp_path, name, monkeypatch, *overrides, **inject):
    real = loop.make_batches
    monkeypatch.setattr(loop, "make_batches", lambda data: (
        lambda b: (Injected(b[0], **inject), b[1]))(real(data)))
    out = tmp_path / name
    summary = loop.train(tiny_config(*BASE, *overrides), out, progress=False)
    return summary, read_metrics(out / "metrics.jsonl"), out


def test_skip_discards_the_update_as_the_nonfinite_guard_does(tmp_path, monkeypatch):
    summary, rows, _ = _run(tmp_path, "skip", monkeypatch, "train.spike_policy=skip")
    nan_summary, nan_rows, _ = _run(tmp_path, "nan", monkeypatch, "train.spike_policy=skip",
                                    poison=(), nan=(SPIKE,))      # the same compiled step
    spiked = [r for r in rows if r.get("event") == "spike_skipped"]
    assert [r["step"] for r in spiked] == [SPIKE + 1] and spiked[0]["skipped"] == 1
    assert summary["spikes"] == [{"step": SPIKE + 1, "event": "spike_skipped",
                                  "loss": spiked[0]["loss"]}]
    assert summary["skipped_steps"] == 1 and nan_summary["skipped_steps"] == 1
    # the same state after it: every later loss bitwise the non-finite run's
    assert [r["loss"] for r in rows if r["step"] > SPIKE + 1] == [
        r["loss"] for r in nan_rows if r["step"] > SPIKE + 1]
    assert [r["loss"] for r in rows[:SPIKE]] == [r["loss"] for r in nan_rows[:SPIKE]]


def test_rollback_skips_the_window_and_equals_a_run_without_it(tmp_path, monkeypatch):
    summary, rows, out = _run(tmp_path, "rollback", monkeypatch, "train.spike_policy=rollback")
    back = [r for r in rows if r.get("event") == "rollback"]
    assert len(back) == 1 and back[0]["to_step"] == 8 and back[0]["skipped_batches"] == [8, 11]
    assert summary["rollbacks"] == 1 and summary["data_position"] == 14 + 3
    # a run that never saw batches 8, 9, 10: the same losses, bitwise, from step 9 on
    _, ref, _ = _run(tmp_path, "ref", monkeypatch, poison=(), skip=(8, 9, 10))
    final = {r["step"]: r["loss"] for r in rows if "event" not in r}
    assert [final[s] for s in range(9, 15)] == [r["loss"] for r in ref if r["step"] >= 9]
    meta = json.loads((out / "checkpoints" / "14" / "meta" / "metadata").read_text())
    assert meta["data_position"] == 17 and meta["guards"]["rollbacks"] == 1
    assert ckpt_meta.scan(out / "checkpoints").complete[-1] == 14
    assert (out / "loss.png").stat().st_size > 0


def test_too_many_rollbacks_stop_the_run_with_a_message(tmp_path, monkeypatch):
    with pytest.raises(loop.TrainingStopped, match=r"stopped after 0 rollback\(s\) \("
                       r"train.max_rollbacks=0\).*raise train.max_rollbacks"):
        _run(tmp_path, "stop", monkeypatch, "train.spike_policy=rollback", "train.max_rollbacks=0")
    assert [r["event"] for r in read_metrics(tmp_path / "stop" / "metrics.jsonl")
            if "event" in r] == ["spike"]


def test_inspect_and_profile_trace_the_guarded_step():
    """`spike_policy=skip` adds the limit to the step's batch: the abstract batch carries it (what
    `inspect` lowers), and `train_batch` adds an infinite one to a batch without it."""
    from jaxscale.strategies.common import LOSS_LIMIT
    from jaxscale.train.setup import build
    setup = build(tiny_config(*BASE, "train.spike_policy=skip"))
    batch = setup.abstract_batch()
    assert batch[LOSS_LIMIT].shape == () and batch[LOSS_LIMIT].sharding.is_fully_replicated
    traced = setup.train_step.trace(setup.abstract_state(), batch)
    assert "spike" in traced.out_info[1]
    assert float(setup.train_batch({})[LOSS_LIMIT]) == math.inf
    assert LOSS_LIMIT not in build(tiny_config(*BASE)).abstract_batch()
