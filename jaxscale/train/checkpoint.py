"""Checkpoints: Orbax async saves, keep-K-plus-every-M, restore onto any mesh, named errors.

One checkpoint is one step directory `<dir>/<step>/` with two items:
- `state`: the whole train state pytree (step, parameters, optimizer state and whatever else the
  state grows, e.g. a loss-scale state), written by every process for the shards it owns
  (Orbax `StandardSave`, tensorstore/OCDBT underneath);
- `meta`: JSON: the step, the data position, the seeds, the resolved config, the shape and dtype
  of every state leaf, the mesh it was written on and the last metrics row.
The listing, the metadata with its checksums, the compatibility check and the named errors live
in `jaxscale.train.checkpoint_meta`.

Atomicity: Orbax writes into `<step>.orbax-checkpoint-tmp*` and renames it to `<step>` only when
every process has finished (the rename is the commit). A process killed mid-save leaves a tmp
directory that is never listed as a step, so only finalized checkpoints are ever restored; the
next manager deletes such leftovers. Nothing here deletes or rewrites a finalized checkpoint
except the retention policy (keep the latest K plus every M-th step).

Async vs sync: an async save blocks the loop only while the state is copied off the devices
(device -> host memory) and returns; serialisation, the disk write and the commit run on a
background thread while training continues. The price is host memory for one extra copy of the
state and a commit that lags the step by the write time (a crash in that window falls back to
the previous checkpoint). A sync save blocks for the whole write. Experiment 28 measures both.

Integrity: a restore recomputes the checksums `meta` records (one per state array, and a SHA-256
of `meta` itself): a flipped byte, a truncated file or edited metadata is named with the array
and the step (`params/layers/mlp/w_up: checksum mismatch in step 40`), and the message names the
newest checkpoint that passes the same checks, to resume from once the damaged one is moved away.
Nothing is deleted or changed on the way.

Elastic restore: the restore target is the *new* setup's abstract state (`ShapeDtypeStruct`s
carrying the new mesh's shardings), so each device reads only the slices of the saved arrays that
it owns: a checkpoint written on dp2 x fsdp2 x tp2 loads onto fsdp4 or one device without ever
assembling a full copy on one device.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import sys
import time
import weakref
from pathlib import Path

import jax

from jaxscale.train import disk
from jaxscale.train.checkpoint_meta import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    _digest,
    check_compatible,
    checksums,
    position_problems,
    require_resumable,
    scan,
)


# ----------------------------------------------------------------------------- manager
class Checkpointer:
    """An Orbax CheckpointManager for one run: save every N, keep K plus every M-th, restore."""

    def __init__(self, directory: Path, ckpt_cfg, *, read_only: bool = False):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as cm
        absl_log = logging.getLogger("absl")            # Orbax logs every save at INFO
        if absl_log.level < logging.WARNING:
            absl_log.setLevel(logging.WARNING)
        self.ocp = ocp
        self.directory = Path(directory).absolute()
        self.cfg = ckpt_cfg
        keep = [cm.LatestN(max(1, ckpt_cfg.keep))]
        if ckpt_cfg.keep_every > 0:
            keep.append(cm.EveryNSteps(ckpt_cfg.keep_every))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=ckpt_cfg.async_save,
            preservation_policy=cm.AnyPreservationPolicy(keep),
            cleanup_tmp_directories=not read_only,    # leftovers of interrupted saves
            create=not read_only, read_only=read_only)
        self.manager = ocp.CheckpointManager(self.directory, item_names=("state", "meta"),
                                             options=options)
        self.last_blocking_s = 0.0
        self.pending: int | None = None      # the step of the save in flight
        self.failures: list[str] = []        # the writer's error reports during that save
        self.error: CheckpointWriteError | None = None
        _quiet_writer_errors()
        _LIVE.add(self)

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Start (async) or do (sync) a save; `last_blocking_s` is the time the caller waited.
        A save that cannot be written raises `CheckpointWriteError` (here or, for an async
        save, from the next `check`, `wait` or `save`)."""
        args = self.ocp.args
        t0 = time.perf_counter()
        self.wait()                          # the previous save (Orbax would wait for it too)
        self.pending, self.failures = int(step), []
        try:
            self.manager.save(int(step), force=True, args=args.Composite(
                state=args.StandardSave(state), meta=args.JsonSave(meta)))
        except Exception as e:   # noqa: BLE001 - a write failure is named, anything else kept
            raise self._failed(f"{type(e).__name__}: {e}", e) from None
        self.last_blocking_s = time.perf_counter() - t0

    def check(self) -> None:
        """Raise the failure of the save in flight as soon as the writer reports it (cheap:
        called every step)."""
        if self.error is not None:
            raise self.error
        if self.pending is not None and self.failures:
            raise self._failed(next((t for t in self.failures if _os_cause(t)),
                                    self.failures[0]))

    def wait(self) -> None:
        """Until the save in flight is finalized; its failure as `CheckpointWriteError`, raised
        as soon as the writer reports it: never a join on writer threads that wait, minutes
        long, for signals from the writes that failed."""
        self.check()
        while self.pending is not None and self.manager.is_saving_in_progress():
            time.sleep(0.02)
            self.check()
        try:
            self.manager.wait_until_finished()          # finished: surfaces a kept error
        except Exception as e:   # noqa: BLE001 - a write failure is named, anything else kept
            raise self._failed(f"{type(e).__name__}: {e}", e) from None
        self.check()
        self.pending = None

    def in_progress(self) -> bool:
        return self.manager.is_saving_in_progress()

    def close(self) -> None:
        """Wait for the save in flight, then close; after a failed save, nothing to wait for."""
        if self.error is None:
            self.wait()
            self.manager.close()
            _LIVE.discard(self)

    def _failed(self, text: str, exc: Exception | None = None) -> Exception:
        """The `CheckpointWriteError` of the save in flight failing with `text` (kept as
        `self.error`), or `exc` itself when `text` names no operating-system cause."""
        cause = _os_cause(text)
        if cause is None and exc is not None:
            return exc
        self.error = CheckpointWriteError(
            f"cannot write checkpoint step {self.pending} to {self.directory}: "
            f"{cause[0] if cause else _first_line(exc or Exception(text))}. "
            f"{self.advice(cause[1] if cause else None, self.directory)}")
        return self.error

    def advice(self, code: int | None, where: Path) -> str:
        """Which checkpoint a rerun continues from, and what to do first about the directory
        `where` that could not be written (`code`: the errno)."""
        latest = scan(self.directory).latest
        if code in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(where).free if where.is_dir() else 0
            fix = f"Free space on its file system ({free / 2**20:.1f} MiB free now)"
        elif code == errno.EROFS:
            fix = "Remount its file system read-write"
        elif code in (errno.EACCES, errno.EPERM):
            fix = "Make it writable for this user"
        else:
            fix = "Fix the directory"
        if latest is None:
            return f"No checkpoint was finalized before it. {fix}, then rerun the same command."
        return (f"The last intact checkpoint is step {latest} ({self.directory / str(latest)}); "
                f"an unfinished save is discarded on resume. {fix}, then rerun the same command "
                f"with --resume.")

    def read_meta(self, step: int) -> dict:
        where = self.directory / str(step)
        try:
            out = self.manager.restore(step, args=self.ocp.args.Composite(
                meta=self.ocp.args.JsonRestore()))
            meta = out.meta
        except Exception as e:   # noqa: BLE001 - any failure to read means a damaged checkpoint
            raise CorruptCheckpointError(
                f"checkpoint {where} is damaged: its metadata cannot be read "
                f"({type(e).__name__}: {_first_line(e)}). {self._aside(step)}") from e
        if not isinstance(meta, dict) or "leaves" not in meta or "config" not in meta:
            raise CorruptCheckpointError(
                f"checkpoint {where} has no jaxscale metadata (meta/metadata is missing or "
                f"incomplete); it was not written by `jaxscale train`. {self._aside(step)}")
        if "digest" in meta and meta["digest"] != _digest(meta):
            raise CorruptCheckpointError(
                f"checkpoint {where} is damaged: meta/metadata: checksum mismatch in step {step} "
                f"(the metadata was changed after it was written). {self._aside(step)}")
        return meta

    def restore(self, step: int, abstract_state, expected: dict | None = None):
        """The state at `step`, laid out as `abstract_state` says (its shardings: any mesh),
        verified against the checksums `expected` (from its metadata) when given."""
        where = self.directory / str(step)
        try:
            state = self._read(step, abstract_state, expected)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"checkpoint {where} is damaged: {e} "
                                         f"{self._aside(step, abstract_state)}") from e
        return state

    def _read(self, step: int, abstract_state, expected: dict | None):
        try:
            out = self.manager.restore(step, args=self.ocp.args.Composite(
                state=self.ocp.args.StandardRestore(abstract_state)))
            state = out.state
            jax.block_until_ready(state)
        except Exception as e:   # noqa: BLE001 - any failure to read means a damaged checkpoint
            raise CorruptCheckpointError(_unreadable(e, step)) from e
        if expected:
            got = checksums(state)
            bad = [k for k in expected if k in got and got[k] != expected[k]]
            if bad:
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                raise CorruptCheckpointError(f"{bad[0]}: checksum mismatch in step {step}{more}; "
                                             f"its arrays cannot be trusted.")
        return state

    def intact(self, step: int, abstract_state) -> bool:
        """Whether `step` reads back and matches every checksum in its metadata."""
        try:
            meta = self.read_meta(step)
            self._read(step, abstract_state, meta.get("checksums"))
            return True
        except CheckpointError:
            return False

    def _aside(self, step: int, abstract_state=None) -> str:
        """What to do: the newest older checkpoint (verified, when `abstract_state` is given)."""
        older = [s for s in scan(self.directory).complete if s < step][::-1]
        if abstract_state is not None:
            older = [next((s for s in older if self.intact(s, abstract_state)), None)]
            older = [s for s in older if s is not None]
        if older:
            intact = "newest intact" if abstract_state is not None else "previous"
            return (f"Nothing was changed. To resume from the {intact} checkpoint (step "
                    f"{older[0]}), move {self.directory / str(step)} out of the directory.")
        return "Nothing was changed; there is no older intact checkpoint to fall back to."


# ----------------------------------------------------------------------------- write failures
#: checkpointers whose writer's error reports are kept on them instead of printed
_LIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def _os_cause(text: str) -> tuple[str, int] | None:
    """(the operating system's reason, its errno) in an error text: TensorStore reports it as
    `[os_error_code='28']`, Python as `[Errno 30]`; None when the text names none."""
    m = re.search(r"os_error_code='?(\d+)", text) or re.search(r"\[Errno (\d+)\]", text)
    return (os.strerror(int(m.group(1))), int(m.group(1))) if m else None


class _WriterReports(logging.Filter):
    """The writer's error records (Orbax's, and asyncio's for its tasks) that name the directory
    of a checkpointer with a save in flight: kept on it, not printed. A failed save logs a
    traceback for each array write and each thread waiting on them; the checkpointer raises one
    `CheckpointWriteError` instead, naming the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f"\n{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        owner = next((c for c in list(_LIVE) if (c.pending is not None or c.error is not None)
                      and str(c.directory) in text), None)
        if owner is None:
            return True
        owner.failures.append(text)
        return False


def _quiet_writer_errors() -> None:
    """Install `_WriterReports`, and drop the "Event loop is closed" reports of TensorStore
    writes that complete after a failed write of the same save closed its event loop."""
    for name in ("absl", "asyncio"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _WriterReports) for f in log.filters):
            log.addFilter(_WriterReports())
    hook = sys.unraisablehook
    if getattr(hook, "_jaxscale", False):
        return

    def quiet(u) -> None:
        if (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
                and any(c.pending is not None or c.error is not None for c in list(_LIVE))):
            return
        hook(u)
    quiet._jaxscale = True
    sys.unraisablehook = quiet


def _unreadable(e: Exception, step: int) -> str:
    """A read failure as `<array>: <reason> in step N`, the array named as in `leaf_signature`
    (TensorStore names it `params.layers.mlp.w_up`) and no internal object reprs."""
    causes, x = [], e
    while x is not None and len(causes) < 8:
        causes.append(str(x))
        x = x.__cause__ or x.__context__
    text = "\n".join(causes)
    name = re.search(r'Error reading "([^"/]+)/', text) or re.search(r"'path': '([^'/]+)/'", text)
    reason = next((line.strip() for c in reversed(causes) for line in c.splitlines()
                   if re.match(r"\s*[A-Z_]+: ", line)), _first_line(e))
    array = name.group(1).replace(".", "/") if name else "the state"
    return f"{array}: cannot be read in step {step} ({reason[:200]})."


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else repr(e)
    return line.split(" See full TensorStore details")[0][:300]


def restore_latest(directory: Path, ckpt_cfg, cfg, abstract_state,
                   layer_order: list[int] | None = None):
    """(checkpointer, state, meta, notes) for the newest finalized checkpoint in `directory`, its
    stacked layers moved into `layer_order` (this plan's stored order; None: the model's) from
    the model's order a checkpoint holds (or, written before, the order its metadata names)."""
    listing = require_resumable(directory)
    ckpt = Checkpointer(directory, ckpt_cfg)
    return (ckpt,) + restore_step(ckpt, listing.latest, cfg, abstract_state, layer_order)


def restore_step(ckpt: Checkpointer, step: int, cfg, abstract_state,
                 layer_order: list[int] | None = None):
    """(state, meta, notes) of checkpoint `step` of `ckpt` (see `restore_latest`)."""
    directory = ckpt.directory
    meta = ckpt.read_meta(step)
    bad = position_problems(meta)
    if bad:
        raise CorruptCheckpointError(
            f"checkpoint {Path(directory) / str(step)} is damaged: the position its metadata "
            f"records is malformed ({'; '.join(bad[:4])}), so a resume cannot continue from it. "
            f"{ckpt._aside(step)}")
    # the true vocabulary, the model's layers
    kept = disk.disk_abstract(abstract_state, cfg.model.vocab_size, layer_order)
    notes = check_compatible(meta, cfg, kept, str(Path(directory) / str(step)))
    state = disk.layers_moved(ckpt.restore(step, kept, meta.get("checksums")),
                              meta.get("layer_order"), None)
    state = disk.from_disk(state, abstract_state, layer_order)
    restored = int(jax.device_get(state.step)) if hasattr(state, "step") else step
    if restored != step:
        raise CorruptCheckpointError(
            f"checkpoint {Path(directory) / str(step)} holds state.step={restored}, not {step}")
    return state, meta, notes
