"""Run configuration: small frozen dataclasses per component, `--set a.b=c` overrides, loading.

An experiment is a Python file with a `config()` function returning `Config`; recipes derive from
each other by calling one another and `dataclasses.replace`. The fully resolved config is saved as
`config.json` in every run directory.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from jaxscale import fields, meshes, models
from jaxscale.data.documents import FORMATS
from jaxscale.fields import nonneg, one_of, positive, ranged
from jaxscale.mesh import MeshConfig
from jaxscale.models.llama import ModelConfig, RopeScaling
from jaxscale.psconfig import PsConfig  # noqa: F401  (the ps group, re-exported)
from jaxscale.strategies.compression import METHODS as COMPRESSIONS
from jaxscale.strategies.dp import SYNC_MODES
from jaxscale.strategies.ep import DISPATCHES
from jaxscale.strategies.local_sgd import METHODS as LOCAL_SGD
from jaxscale.strategies.overlap import MODES as TP_OVERLAPS
from jaxscale.strategies.overlap import XLA_PRESETS
from jaxscale.strategies.pp import SCHEDULES
from jaxscale.strategies.precision import PRECISIONS
from jaxscale.strategies.qat import METHODS as QAT_METHODS
from jaxscale.strategies.sp import CONTEXTS

# Every field states its valid values next to its default (`jaxscale.fields`); `check(cfg)`
# reports every violation at once, before anything is compiled, read or written.


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"            # "stdlib" (this Python's own sources) or comma-separated
                                      # globs
    seq_len: int = positive(128)
    batch_size: int = positive(16)    # global batch, in sequences
    heldout_fraction: float = ranged(0.05, above=0, below=1)
    max_bytes: int = positive(16_000_000)   # cap on corpus bytes read (in-memory path)
    seed: int = nonneg(0)
    tokenizer: str = "bytes"          # "bytes" | tokenizer.json | SentencePiece .model |
                                      # .tiktoken | Hugging Face directory (jaxscale.data.tokenizer)
    format: str = one_of("auto", *FORMATS)   # how files hold documents: auto (by suffix) |
                                      # text (a file each) | jsonl (a line each) | parquet (a row)
    text_field: str = "text"          # the jsonl field / parquet column holding the text
    shards: str = ""                  # "" : windows of the in-memory corpus (default); else a
                                      # directory from `jaxscale data prepare`: streamed, packed

    def relations(self) -> list[str]:
        errs = []
        if not self.tokenizer.strip():
            errs.append("data.tokenizer='': give 'bytes' or the path of a tokenizer file or "
                        "Hugging Face directory")
        if not self.text_field.strip():
            errs.append("data.text_field='': name the jsonl field or parquet column that holds "
                        "the text (e.g. text)")
        return errs


@dataclass(frozen=True)
class OptimConfig:
    lr: float = positive(3e-3)
    warmup_steps: int = nonneg(20)
    decay_steps: int = nonneg(0)      # 0: decay over train.steps
    min_lr_ratio: float = ranged(0.1, lo=0, hi=1)
    weight_decay: float = nonneg(0.1)
    b1: float = ranged(0.9, lo=0, below=1)
    b2: float = ranged(0.95, lo=0, below=1)
    eps: float = nonneg(1e-8)
    clip_norm: float = nonneg(1.0)    # 0: no clipping
    kind: str = one_of("adamw", "adamw", "sgd")   # sgd: lr, momentum, weight_decay (coupled)
    momentum: float = ranged(0.0, lo=0, below=1)  # sgd's heavy-ball momentum (0: plain SGD)


@dataclass(frozen=True)
class PlanConfig:
    """Strategy options beyond the mesh degrees (which imply DP / FSDP / TP)."""
    donate: bool = True               # donate the train state to the step
    precision: str = one_of("fp32", *PRECISIONS)  # fp32 master weights for 16-bit
    loss_scale: str = "auto"          # auto (dynamic for fp16) | dynamic | none | initial scale
    accumulate: int = positive(1)     # micro-batches per optimizer step
    grad_sync: str = one_of("auto", *SYNC_MODES)  # when gradients are reduced over the data
                                      # axes: auto (replicated axes once per step, split axes
                                      # per micro-batch) | step | microbatch (strategies/dp)
    remat: str = "none"               # none | full | save_dots | save_attention_out | offload |
                                      # custom mapping "name:save|remat|offload,..."
    offload: str = "none"             # none | optimizer | master | params, "+"-joined
    offload_tier: str = one_of("host", "host", "nvme")  # where plan.offload's parts live:
                                      # host RAM, or files under offload_dir (ZeRO-Infinity)
    offload_update: str = one_of("device", "device", "host")  # who runs their AdamW: the
                                      # device, a layer at a time, or the host CPU (ZeRO-Offload)
    offload_delay: bool = False       # host update: one-step delayed parameter update (DPU)
    offload_dir: str = ""             # offload_tier=nvme: an existing, writable directory
    zero: int = ranged(0, lo=0, hi=3)  # ZeRO stage over the data-parallel devices
    check_memory: bool = True         # refuse plans the planner predicts will not fit
    context: str = one_of("ring", *CONTEXTS)      # context parallelism over mesh.sp
    sequence_parallel: bool = False   # Megatron sequence parallelism over mesh.tp
    tp_overlap: str = one_of("none", *TP_OVERLAPS)  # TP+SP matmuls as collective matmuls
    xla_preset: str = one_of("default", *XLA_PRESETS)  # XLA scheduler options (overlap.py)
    schedule: str = one_of("1f1b", *SCHEDULES)    # pipeline schedule over mesh.pp
    virtual_stages: int = positive(1)  # virtual pipeline stages per device (interleaved)
    stage_layers: str = "auto"        # layers of each pipeline stage, "3,5" (one count per
                                      # stage), or auto: balanced against the embedding and head
    compression: str = one_of("none", "none", *COMPRESSIONS)  # gradient compression over dp
    compression_block: int = positive(256)     # elements per scale (fp8, int8, sign)
    compression_density: float = ranged(0.01, above=0, hi=1)  # topk/threshold: share sent
    compression_threshold: float = nonneg(0.0)  # threshold: send |g| >= this (cap: density)
    compression_rank: int = positive(4)        # PowerSGD rank
    local_sgd: str = one_of("none", "none", *LOCAL_SGD)  # local SGD over dp (strategies/local_sgd)
    local_steps: int = positive(1)    # H: inner steps between two averages of the replicas
    local_warmup: int = nonneg(0)     # post_local: synchronous steps before going local
    outer_lr: float = nonneg(0.0)     # 0: the method's (local, post_local, slowmo 1; diloco 0.7)
    outer_momentum: float = ranged(-1.0, lo=-1, below=1)  # -1: the method's (slowmo 0.5,
                                      # diloco 0.9 Nesterov, local and post_local 0)
    outer_fragments: int = positive(1)  # Streaming DiLoCo: F strided layer fragments, averaged
    outer_delay: int = one_of(0, 0, 1, note="an XLA collective starts and ends in one compiled "
                              "step, so an average can overlap the step it is issued in only")
    outer_mix: float = ranged(0.5, lo=0, hi=1)  # delayed: the replica's own share when merging
    prune: str = "none"               # none | magnitude | N:M (e.g. 2:4): the block matmul
                                      # weights pruned after every update (strategies/prune)
    prune_sparsity: float = ranged(0.5, lo=0, below=1)   # magnitude: target share of zeros
    prune_start: int = nonneg(0)      # step the cubic sparsity ramp starts (magnitude)
    prune_end: int = nonneg(0)        # step it reaches prune_sparsity; 0: at prune_start
    sparse_embedding: bool = False    # dp: exchange only the embedding rows a device touched
    qat: str = one_of("none", "none", *QAT_METHODS)  # 8-bit block matmuls (strategies/quant)
    fp8_amax_history: int = nonneg(16)  # fp8 delayed scaling's amax history; 0: just in time
    moe_dispatch: str = one_of("padded", *DISPATCHES)  # grouped experts' exchange over ep:
                                      # padded (counts, then bounded blocks; any backend) |
                                      # ragged (jax.lax.ragged_all_to_all; GPU) (strategies/ep)
    moe_buffer: float = ranged(2.0, above=0, note="rows sent per peer, in units of the "
                               "balanced share: f x tokens x top_k / ep")  # the bound's factor f
    zeropp: str = "none"              # ZeRO++ on ZeRO-3/FSDP: none | all | qwz, hpz, qgz
                                      # '+'-joined (quantised weight gathers, hierarchical
                                      # secondary partition, quantised gradient reduce-scatter)
    zeropp_block: int = positive(256)  # elements per fp32 scale of qwZ's and qgZ's blocks
    qgz_bits: int = one_of(4, 4, 8)   # qgZ: gradients quantised to int4 or int8
    fp8_param_gather: bool = False    # plan.qat=fp8: weights all-gathered in e4m3 with scales


@dataclass(frozen=True)
class TrainConfig:
    steps: int = positive(200)
    eval_every: int = nonneg(50)      # 0: no evaluation
    eval_batches: int = positive(4)
    log_every: int = positive(1)
    seed: int = nonneg(0)
    peak_flops: float = nonneg(0.0)   # per device; 0: from the hardware table
    out: str = ""                     # run directory; "" -> runs/<name>
    nonfinite: str = one_of("skip", "skip", "stop")   # non-finite loss or grad norm: skip the
                                      # update | stop the run
    # loss spikes (jaxscale.train.spikes): a loss above the rolling window of accepted losses
    spike_policy: str = one_of("off", "off", "skip", "rollback")   # skip the update | restore
                                      # the last good checkpoint and skip the batches since it
    spike_window: int = ranged(32, lo=4)          # accepted losses the detector compares with
    spike_method: str = one_of("zscore", "zscore", "ratio")
    spike_threshold: float = positive(6.0)        # z-score above the window mean, or loss/mean
    max_rollbacks: int = nonneg(3)                # more rollbacks than this stop the run
    # supervision (jaxscale.train.supervise): per-process step times and a hang watchdog
    straggler_every: int = nonneg(50)             # gather every process's step time every N
                                      # steps (0: never; one process: nothing to compare)
    straggler_factor: float = ranged(1.5, above=1)   # slower than the median by this: named
    hang_factor: float = ranged(10.0, above=1)    # no step within this x the median step time
    hang_min_s: float = positive(300.0)           # ... nor within this many seconds: a hang
    teacher: str = ""                 # distillation: the teacher's run or checkpoint dir
    distill_temperature: float = positive(1.0)   # softmax temperature T of the KL term
    distill_alpha: float = ranged(0.5, lo=0, hi=1)   # loss = a T^2 KL + (1 - a) CE


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = nonneg(100)          # save every N steps; 0: only at the end and on preemption
    keep: int = positive(3)           # keep the latest K checkpoints ...
    keep_every: int = nonneg(0)       # ... plus every step that is a multiple of M (0: none)
    async_save: bool = True           # write in the background while training continues
    dir: str = ""                     # "" -> <run dir>/checkpoints


@dataclass(frozen=True)
class Config:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    ps: PsConfig = field(default_factory=PsConfig)

    def relations(self) -> list[str]:
        """Checks that relate fields of different groups (each group's own are in its class)."""
        errs = []
        if self.data.seq_len > self.model.max_seq_len:
            errs.append(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                        f"{self.model.max_seq_len}")
        return errs


def check(cfg: Config) -> list[str]:
    """Every problem of `cfg`, one message each: every field against its declared range or
    choices, then the checks relating fields (`ModelConfig.relations`, `Config.relations`).
    Nothing is read or written; [] when valid."""
    if not isinstance(cfg, Config):
        return [f"expected a jaxscale.config.Config, got {type(cfg).__name__}"]
    return fields.problems(cfg)


def run_directory(cfg: Config, out=None) -> str:
    """Where a run writes: `out` (`--out`), else `train.out`, else `runs/<name>`."""
    return str(out or cfg.train.out or f"runs/{cfg.name}")


def data_problems(cfg: Config) -> list[str]:
    """What stops a command that reads the training data (`jaxscale.data.problems`): every
    `data.source` glob must match a file, files must be non-empty and hold `data.text_field`,
    the tokenizer and `data.shards` must be readable and agree, and the model's vocabulary must
    hold the tokenizer's ids (a model loaded with its own vocabulary, e.g. from Hugging Face, is
    fine until it is fed this data)."""
    from jaxscale.data import problems
    return problems(cfg.data, cfg.model.vocab_size)


def path_problems(cfg: Config, out, out_key: str, checkpoints: bool = False,
                  data: bool = False) -> list[str]:
    """What stops a command that writes into `out` (named `out_key` in messages: `--out`,
    `train.out`, ...) from starting: `out` (and `ckpt.dir` when `checkpoints`) must be, or be
    creatable as, a writable directory; with `data`, the data can be read (`data_problems`).
    Nothing is created."""
    errs = [e for e in [fields.dir_problem(out, out_key)] if e]
    if checkpoints:
        if cfg.ckpt.dir:
            errs += [e for e in [fields.dir_problem(cfg.ckpt.dir, "ckpt.dir")] if e]
        elif not errs:
            errs += [e for e in [fields.dir_problem(Path(out) / "checkpoints",
                                                    "checkpoint directory")] if e]
    if data:
        errs += data_problems(cfg)
    return errs


# ----------------------------------------------------------------------------- overrides
_PRESETS = {"model": (models.get, models.CONFIGS), "mesh": (meshes.get, meshes.PRESETS)}


def _field_types(cls) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse(raw: str, typ, key: str):
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if raw.lower() in ("none", "null", ""):
            return None
        typ = args[0]
    if typ is RopeScaling:
        if raw.lower() in ("llama3", "default", "true"):
            return RopeScaling()
        raise ValueError(f"{key}: give 'none' or 'llama3' (set fields as {key}.factor=...)")
    try:
        if typ is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:           # 128, 16e6, 128.0; not 1.5 (no silent truncation)
            try:
                return int(raw)
            except ValueError:
                f = float(raw)
                if not f.is_integer():
                    raise ValueError from None
                return int(f)
        if typ is float:
            return float(raw)
        if typ is str:
            return raw
    except ValueError:
        raise ValueError(f"bad value {raw!r} for {key}: expected {typ.__name__}") from None
    raise ValueError(f"{key} cannot be set from the command line (type {typ})")


def _set(obj, path: list[str], raw: str, prefix: str):
    name = path[0]
    key = f"{prefix}{name}"
    ftypes = _field_types(type(obj))
    if name not in ftypes:
        raise KeyError(f"unknown config key {key!r}; valid keys here: "
                       f"{', '.join(prefix + n for n in ftypes)}")
    cur = getattr(obj, name)
    if len(path) == 1:
        if name in _PRESETS and obj.__class__ is Config:   # --set model=llama3-8b / mesh=cpu8
            return dataclasses.replace(obj, **{name: _PRESETS[name][0](raw)})
        if dataclasses.is_dataclass(cur) and not isinstance(cur, type):
            raise KeyError(f"{key!r} is a group; set one of its fields, e.g. "
                           f"{key}.{dataclasses.fields(cur)[0].name}=...")
        return dataclasses.replace(obj, **{name: _parse(raw, ftypes[name], key)})
    if cur is None and ftypes[name] in (typing.Optional[RopeScaling],):
        cur = RopeScaling()
    if not dataclasses.is_dataclass(cur):
        raise KeyError(f"{key!r} is a value, not a group; use --set {key}=VALUE")
    return dataclasses.replace(obj, **{name: _set(cur, path[1:], raw, key + ".")})


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `a.b=c` strings in order; errors name the key and list the valid ones."""
    for item in overrides or ():
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value (e.g. mesh.dp=8)")
        key, raw = item.split("=", 1)
        cfg = _set(cfg, key.strip().split("."), raw.strip(), "")
    return cfg


def apply_each(cfg: Config, overrides: list[str]) -> tuple[Config, list[str]]:
    """`apply_overrides`, one at a time: the config with every valid override applied and one
    message per override that failed (unknown key, unparsable value), so all are reported."""
    errs = []
    for item in overrides or ():
        try:
            cfg = apply_overrides(cfg, [item])
        except (KeyError, ValueError) as e:
            errs.append(e.args[0] if isinstance(e, KeyError) and e.args else str(e))
    return cfg, errs


# ----------------------------------------------------------------------------- loading
def experiments_dirs() -> list[Path]:
    here = Path(__file__).resolve().parent.parent / "experiments"
    return [Path.cwd() / "experiments", here]


def list_experiments() -> list[str]:
    names = set()
    for d in experiments_dirs():
        if d.is_dir():
            for p in d.glob("*.py"):
                if not p.stem.startswith("_") and "def config(" in p.read_text(errors="ignore"):
                    names.add(p.stem)
    return sorted(names)


def load_experiment(name_or_path: str) -> Config:
    path = Path(name_or_path)
    if not (path.suffix == ".py" and path.is_file()):
        path = None if name_or_path.startswith("_") else next(
            (d / f"{name_or_path}.py" for d in experiments_dirs()
             if (d / f"{name_or_path}.py").is_file()), None)
    if path is None:
        raise ValueError(f"unknown experiment {name_or_path!r}; give a path to a .py file with a "
                         f"config() function or one of: {', '.join(list_experiments())}")
    spec = importlib.util.spec_from_file_location(f"jaxscale_experiment_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:     # IndentationError too: file:line: message, no traceback
        where = f"{e.filename or path}:{e.lineno}" + (f":{e.offset}" if e.offset else "")
        raise ValueError(f"{where}: {e.msg}") from None
    if not hasattr(mod, "config"):
        raise ValueError(f"{path} has no config() function")
    cfg = mod.config()
    if not isinstance(cfg, Config):
        raise TypeError(f"{path}: config() must return jaxscale.config.Config, got {type(cfg)}")
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save(cfg: Config, path: Path) -> None:
    path.write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def from_dict(d: dict) -> Config:
    def build(cls, data):
        kw = {}
        ftypes = _field_types(cls)
        for k, v in data.items():
            t = ftypes[k]
            sub = [a for a in typing.get_args(t) if dataclasses.is_dataclass(a)] or (
                [t] if dataclasses.is_dataclass(t) else [])
            kw[k] = build(sub[0], v) if sub and isinstance(v, dict) else v
        return cls(**kw)
    return build(Config, d)


def replace_resolved_mesh(cfg: Config, mesh_cfg: MeshConfig) -> Config:
    """The config with the mesh degrees as resolved against the devices (no -1 left)."""
    return dataclasses.replace(cfg, mesh=mesh_cfg)
