"""Loss spikes: detection over a rolling window, and the two ways out (`train.spike_policy`).

Detection. The detector keeps the last `train.spike_window` accepted losses (a spike, a skipped
or rolled-back step, never enters it). Once the window is full, a step's loss is a spike when it
is above the window's limit:
    zscore:  mean + spike_threshold x std   (std at least 1e-3 x mean: a flat window is not a
                                             hair trigger)
    ratio:   spike_threshold x mean          (e.g. spike_threshold=1.5)
Only losses above the window count: a falling loss never trips it.

Policies:
- `skip`: the limit travels into the jitted step with each batch (`common.LOSS_LIMIT`, a
  replicated scalar), which leaves the state untouched when the loss is above it, as it does for
  a non-finite step (`skipped=1`, `spike=1`; the loss scale does not shrink). The batch is
  consumed; training goes on with the next one. No extra memory, no extra pass.
- `rollback`: the step is taken; when its loss is a spike, the loop restores the last
  checkpoint before it (the initial state when there is none), skips the batches from that
  checkpoint's data position up to and including the spiking one (the data window that led to
  it), and continues from the checkpoint's step with the batch after the spike. More than
  `train.max_rollbacks` rollbacks in a run stop it with a message (the count is kept in the
  checkpoints, so a resumed run counts on).
Every event is a metrics.jsonl row (`event`: "spike_skipped" | "rollback") and is listed in the
summary's `spikes`.
"""
from __future__ import annotations

import math
from collections import deque


class SpikeDetector:
    """The rolling window and its limit (see the module docstring)."""

    def __init__(self, train_cfg, history=()):
        self.size = train_cfg.spike_window
        self.method, self.threshold = train_cfg.spike_method, train_cfg.spike_threshold
        self.window: deque[float] = deque(history, maxlen=self.size)

    def limit(self) -> float:
        """The largest loss that is not a spike (inf until the window is full)."""
        if len(self.window) < self.size:
            return math.inf
        mean = sum(self.window) / self.size
        if self.method == "ratio":
            return self.threshold * mean
        std = math.sqrt(sum((x - mean) ** 2 for x in self.window) / self.size)
        return mean + self.threshold * max(std, 1e-3 * abs(mean))

    def describe(self, loss: float) -> str:
        mean = sum(self.window) / max(len(self.window), 1)
        return (f"loss {loss:.4g} above the limit {self.limit():.4g} ({self.method} "
                f"{self.threshold:g} over the last {len(self.window)} losses, mean {mean:.4g})")

    def accept(self, loss: float) -> None:
        if math.isfinite(loss):
            self.window.append(float(loss))

    def state(self) -> list[float]:
        return list(self.window)


class Guard:
    """One run's spike policy: the detector, the rollback count and the events (see the module
    docstring). `say` prints a line (process 0's stderr)."""

    def __init__(self, cfg, guards: dict, kept_rows: list[dict], say):
        self.cfg, self.policy, self.say = cfg, cfg.train.spike_policy, say
        self.detector = SpikeDetector(cfg.train, guards.get("window", ()))
        self.rollbacks = int(guards.get("rollbacks", 0))
        self.events = [r for r in kept_rows if r.get("event") in ("spike_skipped", "rollback")]

    def limit(self) -> float:
        """The loss limit this step's batch carries (`skip`; the step applies it)."""
        return self.detector.limit()

    def check(self, row: dict, metrics: dict, used: int) -> str | None:
        """What a step's spike needs done ("skipped" | "rollback"), or None (its loss then
        enters the window unless the step was skipped as non-finite)."""
        spiked = bool(metrics.get("spike", 0)) or (
            self.policy == "rollback" and not row["skipped"]
            and row["loss"] > self.detector.limit())
        if not spiked:
            if not row["skipped"]:
                self.detector.accept(row["loss"])
            return None
        self.what = (f"loss spike at step {row['step']} (batch {used}): "
                     f"{self.detector.describe(row['loss'])}")
        if self.policy == "skip":
            row["event"] = "spike_skipped"
            self.events.append({k: row[k] for k in ("step", "event", "loss")})
            self.say(f"jaxscale train: {self.what}: update skipped (train.spike_policy=skip)")
            return "skipped"
        return "rollback"

    def roll_back(self, setup, ckpt, order, row: dict, used: int, ckdir, stopped_error):
        """(state, step) of the last checkpoint before the spike (the initial state when there
        is none), the rollback recorded; past `train.max_rollbacks`, `stopped_error` raised."""
        import time

        from jaxscale.train import checkpoint as ckpt_lib
        cap, done = self.cfg.train.max_rollbacks, row["step"]
        ckpt.wait()
        if self.rollbacks >= cap:
            raise stopped_error(
                f"{self.what}: stopped after {self.rollbacks} rollback(s) (train.max_rollbacks="
                f"{cap}). Checkpoints in {ckdir} hold the state before it. Lower optim.lr or "
                f"optim.clip_norm, inspect batch {used} of the data, or raise "
                f"train.max_rollbacks.")
        t0 = time.perf_counter()
        good = [s for s in ckpt.steps() if s < done]
        if good:
            state, meta, _ = ckpt_lib.restore_step(ckpt, good[-1], self.cfg,
                                                   setup.abstract_state(), order)
            state, step = setup.adopt(state), good[-1]
            skip_from = int(meta.get("data_position", step))
        else:
            state, step, skip_from = setup.init_state(), 0, 0
        self.rollbacks += 1
        event = {"step": done, "event": "rollback", "loss": row["loss"], "to_step": step,
                 "skipped_batches": [skip_from, used + 1], "rollbacks": self.rollbacks,
                 "restore_s": time.perf_counter() - t0}
        self.events.append(event)
        self.say(f"jaxscale train: {self.what}: rolled back to step {step}; batches {skip_from} "
                 f"to {used} skipped (rollback {self.rollbacks} of at most {cap}, "
                 f"train.spike_policy=rollback)")
        return state, step, event

    def state(self) -> dict:
        """What checkpoints keep of it (`meta["guards"]`)."""
        return {"rollbacks": self.rollbacks, "window": self.detector.state()}
