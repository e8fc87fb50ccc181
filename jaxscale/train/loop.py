"""The training loop: progress bar, metrics (JSONL + TensorBoard), held-out evaluation, loss plot,
checkpoints, exact resume, preemption, the non-finite and loss-spike policies, supervision.

Per step it reports loss, gradient norm, learning rate, tokens/s, step time, MFU and `skipped`
(a mixture of experts adds its router losses and dropped fraction, `grads.MOE_METRICS`),
where MFU = model FLOPs per token (`ModelConfig.flops_per_token`: 6 x matmul parameters + causal
attention) x tokens/s / (peak FLOP/s per device x devices); the peak comes from
`jaxscale.hardware` for `mesh.device_kind` and the compute dtype, or from `train.peak_flops`.
Step times exclude the first step (compilation) from tokens/s.

Checkpoints (`jaxscale.train.checkpoint`): every `ckpt.every` steps, at the end, and on preemption.
`resume=True` restores the latest finalized checkpoint in the run directory and continues from
its step and data position (the next batch's index; a streamed source's saved state, so nothing
is replayed), bitwise the uninterrupted run on the same mesh. metrics.jsonl keeps the rows up to
the restored step and the resumed rows replace anything written after it; TensorBoard purges
events after that step. A checkpoint (or a run file) that cannot be written, the directory full
or read-only, stops the run at once (`ckpt.check()` every step sees an async save's failure)
with one message naming the directory, the cause and the last intact checkpoint, and status
`supervise.EXIT_RESTARTABLE`.

Preemption (`preemption.py`): the first SIGTERM or SIGINT lets the current step finish, then a
checkpoint is saved and `train` returns with `stopped="SIGTERM"`; a second signal exits at once.
With several processes, they agree on the stopping step (one tiny all-gather per step).

Non-finite steps: the step already refuses a non-finite update (`skipped=1`). `train.nonfinite=
skip` counts it and carries on; `stop` ends the run without saving that step, keeping the last
good checkpoint, and raises `TrainingStopped` naming it. Loss spikes: `train.spike_policy`
(`spikes.py`: skip the update in the step, or roll back and skip the batches since the last
checkpoint). Supervision (`supervise.Monitor`): heartbeats and the hang watchdog, the straggler
report every `train.straggler_every` steps.
"""
from __future__ import annotations

import errno
import json
import sys
import time
from pathlib import Path

import jax

from jaxscale import config as config_lib
from jaxscale import hardware
from jaxscale.data import Batches, make_batches
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train import disk, spikes
from jaxscale.train.grads import DISTILL_METRICS, MOE_METRICS
from jaxscale.train.metrics import MetricsWriter, plot_loss, read_metrics
from jaxscale.train.preemption import Preemption
from jaxscale.train.setup import build
from jaxscale.train.supervise import Monitor, RestartableError


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite policy `stop`); the message says what is kept."""


def evaluate(setup, params, batches: Batches, n: int) -> float:
    total, count = 0.0, 0.0
    sh = setup.batch_shardings()
    for i in range(n):
        s, c = setup.eval_step(params, batches.device_batch(i, sh))
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def _say(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


def train(cfg, out: Path | None = None, progress: bool = True, resume: bool = False,
          resume_command: str = "") -> dict:
    """Run `cfg` to `cfg.train.steps` (from the latest checkpoint if `resume`); returns a summary.

    `resume_command` is the command line printed in messages that say how to resume. A signal
    that arrives while the run starts (restore, compilation) is honoured after the first step."""
    from jaxscale.fields import raise_problems
    # the fields are checked with the plan (`build`); what only training needs, here
    raise_problems(config_lib.data_problems(cfg))
    with Preemption() as pre:
        return _train(cfg, Path(config_lib.run_directory(cfg, out)), progress, resume,
                      resume_command, pre)


def _train(cfg, out: Path, progress: bool, resume: bool, resume_command: str,
           pre: Preemption) -> dict:
    hint = f": {resume_command}" if resume_command else " (the same command plus --resume)"
    setup = build(cfg)
    cfg = config_lib.replace_resolved_mesh(cfg, setup.placement.mesh_cfg)
    ckdir = ckpt_meta.directory_for(cfg, out)
    start, notes, pos, guards = 0, [], 0, {}
    order = setup.layout.layer_order
    train_b, eval_b = make_batches(cfg.data)
    if resume:
        ckpt, state, meta, notes = ckpt_lib.restore_latest(ckdir, cfg.ckpt, cfg,
                                                           setup.abstract_state(), order)
        start, guards = meta["step"], meta.get("guards") or {}
        pos = meta.get("data_position", start)
        if meta.get("data_state") and hasattr(train_b, "restore"):
            train_b.restore(meta["data_state"])           # O(1): no replay of the stream
        state = setup.adopt(state)
        _say(f"jaxscale train: resumed from {ckdir / str(start)} (step {start}, data position "
             f"{pos})")
        for n in notes:
            _say(f"jaxscale train: note: config differs from the checkpoint: {n}")
    else:
        ckpt_meta.refuse_overwrite(ckdir, "" if not resume_command else f" ({resume_command})")
        ckpt = ckpt_lib.Checkpointer(ckdir, cfg.ckpt)
        state = setup.init_state()
    out.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        config_lib.save(cfg, out / "config.json")
    n_dev = jax.device_count()
    compute = setup.policy.compute_dtype

    def mfu(flops, seconds):
        return hardware.mfu(flops, seconds, cfg.mesh.device_kind, compute, n_dev,
                            cfg.train.peak_flops)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_step = cfg.model.flops_per_token(cfg.data.seq_len) * tokens_per_step

    writer = MetricsWriter(out, resume_step=start if resume else None)
    evals = [r["eval_loss"] for r in writer.kept if "eval_loss" in r]
    first_eval = evals[0] if evals else None
    last_eval = evals[-1] if evals else None
    skipped = sum(int(r.get("skipped", 0)) for r in writer.kept)
    guard = spikes.Guard(cfg, guards, writer.kept, _say)
    sh = setup.batch_shardings()
    bar = None
    if progress and jax.process_index() == 0:
        from tqdm import tqdm
        bar = tqdm(total=cfg.train.steps, initial=start, desc=cfg.name, unit="step",
                   dynamic_ncols=True)
    timed_tokens, timed_secs = 0, 0.0
    saved = set(ckpt.steps())
    stopped, row, done, step = None, None, start, start

    def save(step_no: int) -> None:
        if step_no not in saved:
            # the true vocabulary, the model's layer order
            kept = disk.to_disk(setup.full_state(state), cfg.model.vocab_size, order)
            data_state = train_b.state() if hasattr(train_b, "state") else None
            ckpt.save(step_no, kept, ckpt_meta.make_meta(
                cfg, kept, step_no, row, pos, data_state, guard.state()))
            saved.add(step_no)

    with Monitor(cfg.train, out, start) as monitor:     # heartbeats, hangs, stragglers
        try:
            while step < cfg.train.steps:
                batch = train_b.device_batch(pos, sh)
                batch = setup.train_batch(batch, guard.limit())
                t0 = time.perf_counter()
                state, m = setup.train_step(state, batch)
                m = jax.device_get(m)
                dt = time.perf_counter() - t0
                done, used, pos = step + 1, pos, pos + 1
                if step > start:
                    timed_tokens += tokens_per_step
                    timed_secs += dt
                tps = tokens_per_step / dt
                row = {"step": done, "loss": float(m["loss"]),
                       "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
                       "tokens_per_s": tps, "step_time_s": dt,
                       "mfu": mfu(flops_per_step, dt),
                       "skipped": int(m.get("skipped", 0))}
                if "loss_scale" in m:
                    row["loss_scale"] = float(m["loss_scale"])
                row.update({key: float(m[key]) for key in MOE_METRICS + DISTILL_METRICS
                            if key in m})
                row.update(monitor.stepped(done, dt))     # every process, every step
                action = guard.check(row, m, used)
                if action == "rollback":
                    writer.write({**row, "event": "spike"})
                    state, step, event = guard.roll_back(setup, ckpt, order, row, used, ckdir,
                                                         TrainingStopped)
                    writer.write(event)
                    if bar is not None:
                        bar.n = step
                        bar.refresh()
                    continue
                step = done
                if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == 1
                                             or done == cfg.train.steps):
                    row["eval_loss"] = evaluate(setup, state.params, eval_b,
                                                cfg.train.eval_batches)
                    first_eval = row["eval_loss"] if first_eval is None else first_eval
                    last_eval = row["eval_loss"]
                if (done % cfg.train.log_every == 0 or "eval_loss" in row or row["skipped"]
                        or "step_time_by_process" in row):
                    writer.write(row)
                skipped += row["skipped"]
                if row["skipped"] and action is None:
                    what = (f"non-finite loss {row['loss']} / grad norm {row['grad_norm']} at "
                            f"step {done}")
                    if cfg.train.nonfinite == "stop":
                        ckpt.wait()
                        good = [s for s in ckpt.steps() if s < done]
                        keep = (f"the last good checkpoint is step {good[-1]} in {ckdir}; "
                                f"resume from it{hint}" if good else
                                f"no checkpoint was written before it (ckpt.every="
                                f"{cfg.ckpt.every})")
                        raise TrainingStopped(
                            f"{what}: stopped (train.nonfinite=stop). The update was not applied "
                            f"and this step was not saved; {keep}. Lower optim.lr, check the "
                            f"data, or set train.nonfinite=skip to step over such batches.")
                    _say(f"jaxscale train: {what}: update skipped (train.nonfinite=skip)")
                if cfg.ckpt.every and done % cfg.ckpt.every == 0:
                    save(done)
                ckpt.check()            # a background save that failed stops the run now
                if bar is not None:
                    post = {"loss": f"{row['loss']:.3f}", "tok/s": f"{tps:,.0f}",
                            "mfu": f"{100 * row['mfu']:.1f}%"}
                    if last_eval is not None:
                        post["eval"] = f"{last_eval:.3f}"
                    bar.set_postfix(post)
                    bar.update(1)
                if pre.agreed() and done < cfg.train.steps:
                    stopped = pre.name or "signal on another process"
                    break
            save(done)
            ckpt.wait()
        except OSError as e:        # the run directory is full or read-only (not a checkpoint)
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise
            try:
                ckpt.wait()                 # a save in flight may still finalize
            except RestartableError:
                pass
            raise RestartableError(
                f"cannot write {e.filename or out}: {e.strerror}. "
                f"{ckpt.advice(e.errno, Path(e.filename or out).parent)}") from None
        finally:
            if bar is not None:
                bar.close()
            writer.close()
            try:
                ckpt.close()
            except Exception:   # noqa: BLE001 - never mask the error that brought us here
                pass
    if stopped:
        _say(f"jaxscale train: stopped by {stopped} after step {done} of {cfg.train.steps}; "
             f"checkpoint saved in {ckdir / str(done)}. Resume with{hint}")
    summary = {"steps": done, "first_eval_loss": first_eval, "last_eval_loss": last_eval,
               "tokens_per_s": timed_tokens / timed_secs if timed_secs else None,
               "mfu": (mfu(flops_per_step * timed_tokens / tokens_per_step, timed_secs)
                       if timed_secs else None), "out": str(out),
               "skipped_steps": skipped, "resumed_from": start if resume else None,
               "data_position": pos, "spikes": guard.events, "rollbacks": guard.rollbacks,
               "checkpoint": str(ckdir / str(done)), "stopped": stopped}
    if jax.process_index() == 0:
        plot_loss(read_metrics(out / "metrics.jsonl"), out / "loss.png", cfg.name)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

