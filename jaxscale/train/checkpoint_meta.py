"""What a checkpoint directory holds and what a checkpoint says about itself: the listing, the
metadata, the per-array checksums, the compatibility check, and the named errors.

Listing: `scan` lists only finalized step directories `<dir>/<step>/`; the tmp directory
(`TMP_MARK`) of a save not yet committed, or interrupted, is a partial save, never a step.

`meta` (JSON, one item of every checkpoint; `make_meta`): the step, the data position, the seeds,
the resolved config, the shape and dtype of every state leaf, the mesh it was written on and the
last metrics row.

Exactness: batches are a pure function of `(data.seed, step)` (`jaxscale.data.Batches`) and the
step itself draws no random numbers, so the data position and the RNG state are fully described
by the step and the two seeds stored in `meta`; restoring the state bitwise therefore resumes the
run bitwise on the same mesh.

Integrity: `meta` records a checksum of every state array (`checksums`: two 32-bit sums of the
array's bits, one weighted by position, computed on the devices; exact integer arithmetic, so
the value does not depend on the mesh) and a SHA-256 of itself, which a restore recomputes
(`jaxscale.train.checkpoint`).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from jaxscale.train.supervise import RestartableError

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


class CheckpointWriteError(RestartableError):
    """A checkpoint that could not be written (a full or read-only directory): the message names
    the directory, the cause and the last intact checkpoint; the run exits restartable."""


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
              data_position: int | None = None, data_state: dict | None = None,
              guards: dict | None = None, extra: dict | None = None) -> dict:
    """What a checkpoint says about itself (`state` as `train.disk.to_disk` gives it: the true
    vocabulary, the layers in the model's order; a checkpoint written before that names its
    stored order in "layer_order", which a restore still honours). `data_position`: the next
    batch's index (the step, unless batches were skipped after a spike); `data_state`: a
    streamed source's position (`PackedBatches.state()`, the same on every process);
    `guards`: the spike policy's rollback count and window; `extra`: more keys (the parameter
    server's worker positions, `jaxscale.ps`)."""
    from jaxscale import config as config_lib
    meta = {
        "version": META_VERSION,
        "step": int(step),
        "data_position": int(step if data_position is None else data_position),  # next batch
        "data_state": data_state,
        "guards": guards or {},
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
    meta.update(extra or {})
    meta["digest"] = _digest(meta)
    return meta


def _count(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0


def _counts(x, n: int | None = None) -> bool:
    return isinstance(x, list) and (n is None or len(x) == n) and all(map(_count, x))


def _kind(x) -> str:
    return f"{x!r} ({type(x).__name__})"


#: a streamed source's position (`data.stream.PackedBatches.state`): field -> its check
_DATA_STATE = {"version": _count, "step": _count, "round": lambda x: _counts(x, 2),
               "emitted": _count, "split": lambda x: isinstance(x, str), "seq_len": _count,
               "seed": _count, "docs": _count,
               "tokenizer": lambda x: x is None or isinstance(x, str)}   # its sha256, if any


def position_problems(meta: dict) -> list[str]:
    """What is malformed in the position a checkpoint's metadata records (the step, the data
    position, a streamed source's state, the spike guard's state): a resume would continue from
    it, so a wrong type must be named here, not met at the first batch."""
    out = []
    if not _count(meta.get("step")):
        out.append(f"step is {_kind(meta.get('step'))}, not a non-negative integer")
    if "data_position" in meta and not _count(meta["data_position"]):
        out.append(f"data_position is {_kind(meta['data_position'])}, not a non-negative "
                   f"integer (the next batch's index)")
    ds = meta.get("data_state")
    if ds is not None and not isinstance(ds, dict):
        out.append(f"data_state is {_kind(ds)}, not a stream position (a JSON object)")
    elif ds is not None:
        out += [f"data_state.{k} is {_kind(ds[k]) if k in ds else 'absent'}"
                for k, ok in _DATA_STATE.items() if not ok(ds.get(k))]
    guards = meta.get("guards") or {}
    if not isinstance(guards, dict):
        out.append(f"guards is {_kind(guards)}, not a JSON object")
    else:
        if "rollbacks" in guards and not _count(guards["rollbacks"]):
            out.append(f"guards.rollbacks is {_kind(guards['rollbacks'])}, not a count")
        window = guards.get("window", [])
        if not isinstance(window, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)
                for v in window):
            out.append(f"guards.window is {str(window)[:60]!r}, not a list of finite losses")
    return out


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
