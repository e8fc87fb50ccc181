"""Checkpoints: Orbax async saves, keep-K-plus-every-M, restore onto any mesh, named errors.

One checkpoint is one step directory `<dir>/<step>/` with two items:
- `state`: the whole train state pytree (step, parameters, optimizer state and whatever else the
  state grows, e.g. a loss-scale state), written by every process for the shards it owns
  (Orbax `StandardSave`, tensorstore/OCDBT underneath);
- `meta`: JSON: the step, the data position, the seeds, the resolved config, the shape and dtype
  of every state leaf, the mesh it was written on and the last metrics row.

Exactness: batches are a pure function of `(data.seed, step)` (`jaxscale.data.Batches`) and the
step itself draws no random numbers, so the data position and the RNG state are fully described
by the step and the two seeds stored in `meta`; restoring the state bitwise therefore resumes the
run bitwise on the same mesh.

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

Integrity: `meta` records a checksum of every state array (`checksums`: two 32-bit sums of the
array's bits, one weighted by position, computed on the devices; exact integer arithmetic, so
the value does not depend on the mesh) and a SHA-256 of itself. A restore recomputes them: a
flipped byte, a truncated file or edited metadata is named with the array and the step
(`params/layers/mlp/w_up: checksum mismatch in step 40`), and the message names the newest
checkpoint that passes the same checks, to resume from once the damaged one is moved away.
Nothing is deleted or changed on the way.

Elastic restore: the restore target is the *new* setup's abstract state (`ShapeDtypeStruct`s
carrying the new mesh's shardings), so each device reads only the slices of the saved arrays that
it owns: a checkpoint written on dp2 x fsdp2 x tp2 loads onto fsdp4 or one device without ever
assembling a full copy on one device.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

TMP_MARK = ".orbax-checkpoint-tmp"
META_VERSION = 2          # 2: per-array checksums and a metadata digest


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed from; the message says why and what to do."""


class NoCheckpointError(CheckpointError):
    """Missing directory, empty directory, or only partially written checkpoints."""


class CorruptCheckpointError(CheckpointError):
    """A finalized checkpoint whose files cannot be read back."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint written for a different model (config or parameter shapes)."""


def directory_for(cfg, out: Path) -> Path:
    return Path(cfg.ckpt.dir) if cfg.ckpt.dir else Path(out) / "checkpoints"


# ----------------------------------------------------------------------------- listing
@dataclass
class Listing:
    directory: Path
    complete: list[int] = field(default_factory=list)     # finalized steps, ascending
    partial: list[str] = field(default_factory=list)      # tmp directories of unfinished saves

    @property
    def latest(self) -> int | None:
        return self.complete[-1] if self.complete else None


def scan(directory: Path) -> Listing:
    """What is in a checkpoint directory, without touching it."""
    d = Path(directory)
    listing = Listing(d)
    if not d.is_dir():
        return listing
    for p in d.iterdir():
        if TMP_MARK in p.name:
            listing.partial.append(p.name)
        elif p.is_dir() and p.name.isdigit():
            # Orbax renames the tmp directory only after every item is written: a plain
            # `<step>` directory is complete (on object stores it would carry commit_success.txt).
            listing.complete.append(int(p.name))
    listing.complete.sort()
    listing.partial.sort()
    return listing


def require_resumable(directory: Path) -> Listing:
    """The listing of a directory that holds at least one finalized checkpoint, or a named error."""
    d = Path(directory)
    if not d.exists():
        raise NoCheckpointError(
            f"cannot resume: there is no checkpoint directory {d} (was the run started with a "
            f"different --out or ckpt.dir?). Drop --resume to start a new run.")
    if not d.is_dir():
        raise NoCheckpointError(f"cannot resume: {d} is a file, not a checkpoint directory")
    listing = scan(d)
    if listing.complete:
        return listing
    if listing.partial:
        raise NoCheckpointError(
            f"cannot resume: {d} holds only partially written checkpoints "
            f"({', '.join(listing.partial)}): their saves were interrupted before they were "
            f"finalized, so nothing complete can be restored. Drop --resume to start again.")
    raise NoCheckpointError(f"cannot resume: the checkpoint directory {d} is empty "
                            f"(no finalized step directories). Drop --resume to start a new run.")


def refuse_overwrite(directory: Path, resume_hint: str = "") -> None:
    """A new (not resumed) run must not write into a directory that already holds checkpoints."""
    listing = scan(directory)
    if listing.complete:
        raise CheckpointError(
            f"{directory} already holds checkpoints (steps "
            f"{', '.join(map(str, listing.complete))}); a new run would overwrite them. Resume it "
            f"with --resume{resume_hint}, or give another --out (or ckpt.dir).")


# ----------------------------------------------------------------------------- metadata
def leaf_signature(tree) -> dict[str, list]:
    """`{"params/layers/attn/wq": [shape..., dtype], ...}` for every leaf of a state pytree."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="/"):
            [list(leaf.shape), str(np.dtype(leaf.dtype))] for path, leaf in flat}


# ----------------------------------------------------------------------------- integrity
def _bits(x):
    """An array's bits as uint32 (16- and 8-bit types widened, 64-bit types split in two)."""
    import jax.numpy as jnp
    size = np.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    kind = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[size]
    return jax.lax.bitcast_convert_type(x, kind).astype(jnp.uint32)


def _leaf_sums(x):
    """(sum of the bits, sum of bits x (position mod 65521 + 1)), both mod 2^32."""
    import jax.numpy as jnp
    b = _bits(x)
    pos = jnp.zeros(b.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(b.ndim)):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, b.shape, d) * jnp.uint32(stride % 2**32)
        stride *= b.shape[d]
    weight = pos % jnp.uint32(65521) + jnp.uint32(1)
    return jnp.stack([jnp.sum(b, dtype=jnp.uint32), jnp.sum(b * weight, dtype=jnp.uint32)])


@jax.jit
def _all_sums(leaves):
    """Every leaf's sums in one program (jit caches it per state layout: compiled once a run)."""
    return [_leaf_sums(x) for x in leaves]


def checksums(state) -> dict[str, str]:
    """`{"params/layers/attn/wq": "89ab01cd12ef3456", ...}`: one checksum per state array,
    computed where the shards live (one read of the state) and independent of the mesh."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    names = [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in flat]
    leaves = [leaf if getattr(leaf.sharding, "memory_kind", None) in (None, "device") else
              jax.device_put(leaf, leaf.sharding.with_memory_kind("device"))
              for _, leaf in flat]
    sums = jax.device_get(_all_sums(leaves))
    return {n: f"{int(s[0]):08x}{int(s[1]):08x}" for n, s in zip(names, sums)}


def _digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def make_meta(cfg, state, step: int, last_row: dict | None = None,
              layer_order: list[int] | None = None) -> dict:
    """What a checkpoint says about itself; `layer_order`: the stored order of the stacked layers
    when it is not the model's (interleaved pipelines, `strategies.pp.program.layer_order`)."""
    from jaxscale import config as config_lib
    meta = {
        "version": META_VERSION,
        "step": int(step),
        "data_position": int(step),          # index of the next batch: Batches.device_batch(step)
        "rng": {"init_seed": cfg.train.seed, "data_seed": cfg.data.seed,
                "note": "batch i = default_rng((data.seed, stream, i)); the step draws no RNG"},
        "config": config_lib.to_dict(cfg),
        "leaves": leaf_signature(state),
        "mesh": {"degrees": cfg.mesh.degrees(), "devices": jax.device_count(),
                 "processes": jax.process_count()},
        "metrics": {k: v for k, v in (last_row or {}).items()
                    if isinstance(v, (int, float)) and np.isfinite(v)},
        "time": time.time(),
        "checksums": checksums(state),
    }
    if layer_order is not None:
        meta["layer_order"] = list(layer_order)
    meta["digest"] = _digest(meta)
    return meta


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict, current: dict, group: str) -> list[str]:
    a, b = _flatten(saved.get(group) or {}, f"{group}."), _flatten(current.get(group) or {},
                                                                    f"{group}.")
    return [f"{k}: checkpoint {a.get(k, '<absent>')!r}, this run {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def check_compatible(meta: dict, cfg, abstract_state, where: str) -> list[str]:
    """Raise if the checkpoint holds a different model; return notes on other config changes."""
    from jaxscale import config as config_lib
    current = config_lib.to_dict(cfg)
    saved_leaves, leaves = meta.get("leaves", {}), leaf_signature(abstract_state)
    problems = []
    # parameters first: they name the model's difference most directly
    keys = sorted(set(saved_leaves) | set(leaves), key=lambda k: (not k.startswith("params"), k))
    for k in keys:
        s, c = saved_leaves.get(k), leaves.get(k)
        if s is None:
            problems.append(f"{k}: absent from the checkpoint (this run has shape {tuple(c[0])})")
        elif c is None:
            problems.append(f"{k}: in the checkpoint (shape {tuple(s[0])}) but not in this run")
        elif s[0] != c[0]:
            problems.append(f"{k}: shape {tuple(s[0])} in the checkpoint, {tuple(c[0])} in "
                            f"this run")
        elif s[1] != c[1]:
            problems.append(f"{k}: dtype {s[1]} in the checkpoint, {c[1]} in this run")
    model_diff = config_differences(meta.get("config", {}), current, "model")
    if problems or model_diff:
        lines = problems[:6] + ([f"... and {len(problems) - 6} more"] if len(problems) > 6 else [])
        raise CheckpointMismatchError(
            f"checkpoint {where} was written for a different model:\n  "
            + "\n  ".join(lines + model_diff[:8]) +
            "\nUse the model config it was written with, or start a new run in another --out.")
    notes = []
    for group in ("optim", "data", "train", "plan", "mesh"):
        notes += config_differences(meta.get("config", {}), current, group)
    return [n for n in notes if not n.startswith(("train.out", "train.steps", "train.nonfinite"))]


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

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Start (async) or do (sync) a save; `last_blocking_s` is the time the caller waited."""
        args = self.ocp.args
        t0 = time.perf_counter()
        self.manager.save(int(step), force=True, args=args.Composite(
            state=args.StandardSave(state), meta=args.JsonSave(meta)))
        self.last_blocking_s = time.perf_counter() - t0

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def in_progress(self) -> bool:
        return self.manager.is_saving_in_progress()

    def close(self) -> None:
        self.manager.close()

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
    the order it was saved in."""
    listing = require_resumable(directory)
    ckpt = Checkpointer(directory, ckpt_cfg)
    step = listing.latest
    meta = ckpt.read_meta(step)
    notes = check_compatible(meta, cfg, abstract_state, str(Path(directory) / str(step)))
    state = ckpt.restore(step, abstract_state, meta.get("checksums"))
    restored = int(jax.device_get(state.step)) if hasattr(state, "step") else step
    if restored != step:
        raise CorruptCheckpointError(
            f"checkpoint {Path(directory) / str(step)} holds state.step={restored}, not {step}")
    from jaxscale.strategies.pp.program import reorder
    return ckpt, reorder(state, meta.get("layer_order"), layer_order), meta, notes
