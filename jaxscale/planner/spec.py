"""What the planner plans: a model, mesh degrees and plan options, normalised and validated.

`Spec.from_config(cfg)` reads a `jaxscale.config.Config`; options the training code does not
have yet (pipeline schedule, virtual stages, context-parallel flavour, Megatron sequence
parallelism, mixture of experts) are planner arguments with documented defaults. `problems()`
lists everything that makes a plan impossible (all at once, each naming the field and a fix), so
`--search` can say why a candidate was rejected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from jaxscale import hardware
from jaxscale.planner.activations import parse_policy
from jaxscale.planner.params import MoE

AXES = ("dp", "pp", "fsdp", "ep", "sp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
SP_MODES = ("ring", "ulysses")
PRECISIONS = {"fp32": None, "bf16": 2, "fp16": 2}
OFFLOADS = ("optimizer", "master", "params")


@dataclass(frozen=True)
class Spec:
    model: object                       # jaxscale.models.llama.ModelConfig
    degrees: dict = field(default_factory=dict)
    dcn: dict = field(default_factory=dict)
    device_kind: str = "cpu"
    batch: int = 8                      # global batch, sequences
    seq: int = 128
    precision: str = "fp32"
    zero: int = 0
    remat: str = "none"
    offload: str = "none"
    accumulate: int = 1                 # micro-batches per step (pipeline: m)
    donate: bool = True
    schedule: str = "1f1b"              # pipeline schedule when pp > 1
    virtual: int = 1                    # virtual stages per device (interleaved)
    sp_mode: str = "ring"               # context parallelism over `sp`
    megatron_sp: bool = False           # split the residual stream over tp as well
    moe: MoE | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg, n_devices: int | None = None, **options) -> "Spec":
        mesh = cfg.mesh
        deg = {a: getattr(mesh, a) for a in AXES}
        if any(d == -1 for d in deg.values()):
            if n_devices is None:
                raise ValueError("the mesh has a -1 (fill) degree: give the device count "
                                 "(jaxscale plan --devices N)")
            mesh = mesh.resolve(n_devices)
            deg = {a: getattr(mesh, a) for a in AXES}
        elif n_devices is not None and math.prod(deg.values()) != n_devices:
            mesh.resolve(n_devices)         # raises the mesh's own message
        plan = cfg.plan
        get = lambda name, default: getattr(plan, name, default)
        return cls(model=cfg.model, degrees=deg,
                   dcn={a: getattr(mesh, f"dcn_{a}", 1) for a in AXES},
                   device_kind=mesh.device_kind, batch=cfg.data.batch_size, seq=cfg.data.seq_len,
                   precision=get("precision", "fp32"), zero=get("zero", 0),
                   remat=get("remat", "none"), offload=get("offload", "none"),
                   accumulate=get("accumulate", 1), donate=get("donate", True), **options)

    def with_(self, **kw) -> "Spec":
        return replace(self, **kw)

    # ------------------------------------------------------------------ derived sizes
    @property
    def n_devices(self) -> int:
        return math.prod(self.degrees.get(a, 1) for a in AXES)

    def deg(self, axis: str) -> int:
        return self.degrees.get(axis, 1)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over (ep carries tokens too: experts live on data ranks)."""
        return tuple(a for a in ("dp", "fsdp", "ep") if self.deg(a) > 1)

    @property
    def data_degree(self) -> int:
        return self.deg("dp") * self.deg("fsdp") * self.deg("ep")

    @property
    def local_batch(self) -> float:
        return self.batch / self.data_degree

    @property
    def micro_batch(self) -> float:
        return self.local_batch / max(1, self.accumulate)

    @property
    def stage_layers(self) -> int:
        """Layers on the busiest pipeline stage (uneven stages hold at most ceil(L / pp))."""
        return math.ceil(self.model.n_layers / self.deg("pp"))

    @property
    def local_seq(self) -> float:
        return self.seq / self.deg("sp")

    @property
    def compute_itemsize(self) -> int:
        """Bytes of an activation element as the backend holds it (XLA:CPU computes 16-bit
        floats in f32: `Hardware.native_16bit`)."""
        size = PRECISIONS.get(self.precision) or _itemsize(self.model.dtype)
        return size if self.hardware.native_16bit else max(size, 4)

    @property
    def wire_param_itemsize(self) -> int:
        """Bytes per parameter or gradient element in a collective (f32 on XLA:CPU)."""
        size = self.param_itemsize
        return size if self.hardware.native_16bit else max(size, 4)

    @property
    def param_itemsize(self) -> int:
        """Bytes of the stored working parameters (and of the gradients)."""
        return PRECISIONS.get(self.precision) or _itemsize(self.model.param_dtype)

    @property
    def mixed(self) -> bool:
        return self.precision in ("bf16", "fp16")

    @property
    def offloaded(self) -> set[str]:
        return set() if self.offload in ("none", "") else set(self.offload.split("+"))

    @property
    def attention(self) -> str:
        """The attention implementation the model resolves to (`jaxscale.attention.resolve`):
        `auto` is a fused kernel on GPUs, and on CPU `xla` up to
        `jaxscale.attention.AUTO_XLA_MAX_SCORES` scores per (batch, head), `blockwise` beyond."""
        impl = self.model.attention
        if impl != "auto":
            return impl
        if self.device_kind != "cpu":
            return "cudnn"
        from jaxscale.attention import AUTO_XLA_MAX_SCORES
        return "xla" if self.seq * self.seq <= AUTO_XLA_MAX_SCORES else "blockwise"

    @property
    def hardware(self) -> hardware.Hardware:
        return hardware.get(self.device_kind)

    def cross_node(self, axes) -> bool:
        """Whether a collective over `axes` leaves a node (some axis has a DCN part)."""
        return any(self.dcn.get(a, 1) > 1 for a in axes)

    def label(self) -> str:
        parts = [f"{a}{self.deg(a)}" for a in AXES if self.deg(a) > 1] or ["single"]
        opts = []
        if self.zero:
            opts.append(f"zero{self.zero}")
        if self.remat not in ("none", ""):
            opts.append(f"remat={self.remat}")
        if self.offload not in ("none", ""):
            opts.append(f"offload={self.offload}")
        if self.accumulate > 1:
            opts.append(f"acc{self.accumulate}")
        if self.deg("pp") > 1:
            opts.append(self.schedule + (f"/v{self.virtual}" if self.schedule == "interleaved"
                                         else ""))
        if self.deg("sp") > 1:
            opts.append(self.sp_mode)
        if self.megatron_sp:
            opts.append("megatron-sp")
        return "x".join(parts) + (" " + " ".join(opts) if opts else "") + f" {self.precision}"

    # ------------------------------------------------------------------ validation
    def problems(self) -> list[str]:
        m, errs = self.model, []
        try:
            m.validate()
        except ValueError as e:
            errs.append(str(e))
        for a in AXES:
            if self.deg(a) < 1:
                errs.append(f"mesh.{a}={self.deg(a)} must be >= 1")
        if errs:
            return errs
        if self.precision not in PRECISIONS:
            errs.append(f"plan.precision={self.precision!r}: valid are {', '.join(PRECISIONS)}")
        if self.zero not in (0, 1, 2, 3):
            errs.append(f"plan.zero={self.zero}: valid are 0, 1, 2, 3")
        bad = self.offloaded - set(OFFLOADS)
        if bad:
            errs.append(f"plan.offload={self.offload!r}: items must be among {', '.join(OFFLOADS)}"
                        f" joined by '+', or 'none'")
        try:
            parse_policy(self.remat)
        except ValueError as e:
            errs.append(str(e))
        if self.accumulate < 1:
            errs.append(f"plan.accumulate={self.accumulate} must be >= 1")
        t = self.deg("tp")
        for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            v = getattr(m, name)
            if v % t:
                errs.append(f"model.{name}={v} is not divisible by mesh.tp={t}: tensor parallelism "
                            f"splits it over tp; pick tp dividing it")
        if m.dim % self.deg("fsdp"):
            errs.append(f"model.dim={m.dim} is not divisible by mesh.fsdp={self.deg('fsdp')}: FSDP "
                        f"shards every parameter on its embed dimension")
        if self.batch % self.data_degree:
            errs.append(f"data.batch_size={self.batch} is not divisible by the data-parallel degree "
                        f"dp x fsdp x ep = {self.data_degree}: use a multiple of it")
        elif self.accumulate >= 1 and (self.batch // self.data_degree) % self.accumulate:
            errs.append(f"the local batch {self.batch // self.data_degree} is not divisible by "
                        f"plan.accumulate={self.accumulate} micro-batches")
        if self.seq > m.max_seq_len:
            errs.append(f"data.seq_len={self.seq} exceeds model.max_seq_len={m.max_seq_len}")
        p, v = self.deg("pp"), self.virtual
        if p > 1:
            if self.schedule not in SCHEDULES:
                errs.append(f"pipeline schedule {self.schedule!r}: valid are {', '.join(SCHEDULES)}")
            stages = p * (v if self.schedule == "interleaved" else 1)
            if m.n_layers < stages:
                errs.append(f"model.n_layers={m.n_layers} is fewer than the {stages} pipeline "
                            f"stages (pp={p}" + (f" x virtual={v}" if stages != p else "") + ")")
            if self.schedule == "interleaved" and self.accumulate % p:
                errs.append(f"the interleaved schedule needs the micro-batch count "
                            f"(plan.accumulate={self.accumulate}) to be a multiple of pp={p}")
        sp = self.deg("sp")
        if sp > 1:
            if self.seq % sp:
                errs.append(f"data.seq_len={self.seq} is not divisible by mesh.sp={sp}")
            if self.sp_mode not in SP_MODES:
                errs.append(f"context parallelism {self.sp_mode!r}: valid are {', '.join(SP_MODES)}")
            if self.sp_mode == "ulysses" and ((m.n_heads // t) % sp or (m.n_kv_heads // t) % sp):
                errs.append(f"Ulysses attention redistributes heads: the {m.n_heads // t} query and "
                            f"{m.n_kv_heads // t} kv heads per tp rank must be divisible by "
                            f"mesh.sp={sp} (use sp_mode=ring)")
        if self.megatron_sp and self.seq % t:
            errs.append(f"Megatron sequence parallelism splits data.seq_len={self.seq} over "
                        f"mesh.tp={t}: it must divide")
        e = self.deg("ep")
        if e > 1 and self.moe is None:
            errs.append(f"mesh.ep={e} needs a mixture-of-experts model (none given); set mesh.ep=1")
        elif self.moe is not None and self.moe.n_experts % e:
            errs.append(f"{self.moe.n_experts} experts are not divisible by mesh.ep={e}")
        if self.device_kind not in hardware.HARDWARE:
            errs.append(f"unknown hardware {self.device_kind!r}; valid: "
                        f"{', '.join(hardware.HARDWARE)}")
        return errs

    def validate(self) -> "Spec":
        errs = self.problems()
        if errs:
            raise ValueError("invalid plan:\n  - " + "\n  - ".join(errs))
        return self


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}.get(dtype, 4)
