"""The plan: one description of a training step's strategies, composed in one written order.

`Spec` is the plan as every consumer reads it: the model, the mesh degrees (and their cross-node
parts), the hardware, the global batch and sequence, and the `plan.*` options, normalised from a
`Config` by `Spec.from_config` (no JAX needed). Each strategy module in `jaxscale/strategies/`
reads a `Spec` through the same few functions (see `jaxscale.strategies`), and this module
composes them, in this order, for every consumer alike (`train`, `inspect`'s theory, `jaxscale
plan` and its `--search`):

1. `problems(spec)`: the model and hardware, then each strategy's problems in `STRATEGIES` order
   (`validate(cfg, n)` checks every config field against its declared range first, `config.check`),
   all reported together, each naming the field and a fix; `unavailable(spec)` adds what `train`
   cannot run yet (the planner still predicts it, and `--search` marks it);
2. `rules(spec)`: the batch over the data axes (`dp`, `fsdp`, `ep`, outer to inner), then each
   strategy's logical->mesh rules; two rules for one logical axis are an error; `layers` stays
   unsharded unless pipeline parallelism maps it to `pp`;
3. `collectives(spec)`: every collective per device per step, each strategy's own formula;
4. `memory_terms(spec)`: each strategy's per-device memory terms (the planner adds the model's);
5. `step_parts(spec)`: what each strategy changes in the train state and step (its
   `shape_step`: ZeRO's state layout, offload's memory kinds and streamed update, precision's
   policy, accumulation, remat's block wrapper, the pipeline engine, context parallelism's token
   layout, compression's gradient mean, pruning after the update, local SGD's own step, fp8
   QAT's probe, XLA's options), from which `jaxscale.train` builds the step, naming no strategy;
6. `place(cfg, devices)`: the JAX side, a `Placement` (the device mesh and the rules) for the
   validated plan (`jaxscale.train.setup` builds from it and from `step_parts`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from jaxscale import hardware
from jaxscale.axes import DATA_AXES, MESH_AXES, Rules
from jaxscale.fields import raise_problems
from jaxscale.strategies import (
    accumulate,
    compression,
    dp,
    ep,
    fsdp,
    local_sgd,
    offload,
    overlap,
    pp,
    precision,
    prune,
    qat,
    remat,
    sp,
    sparse_embedding,
    tp,
    zero,
    zeropp,
)
from jaxscale.strategies.common import StepParts

#: every strategy, in the order their problems, rules, collectives, memory terms and step parts
#: compose
STRATEGIES = (dp, fsdp, zero, zeropp, tp, sp, overlap, ep, pp, precision, accumulate, remat,
              offload, compression, sparse_embedding, prune, local_sgd, qat)
#: the `plan.*` options a `Spec` carries (each is a `PlanConfig` field of the same name)
OPTIONS = ("precision", "loss_scale", "zero", "remat", "offload", "offload_tier",
           "offload_update", "offload_delay", "offload_dir", "accumulate", "grad_sync",
           "donate", "context",
           "sequence_parallel", "tp_overlap", "xla_preset", "schedule", "virtual_stages",
           "stage_layers", "compression", "compression_block", "compression_density",
           "compression_threshold", "compression_rank", "prune",
           "prune_sparsity", "prune_start", "prune_end", "sparse_embedding", "local_sgd",
           "local_steps", "local_warmup", "outer_lr", "outer_momentum", "outer_fragments",
           "outer_delay", "outer_mix", "qat", "fp8_amax_history",
           "moe_dispatch", "moe_buffer", "zeropp", "zeropp_block", "qgz_bits",
           "fp8_param_gather")


def moments(optim) -> int:
    """Per-parameter moment tensors of the optimizer (`train.state.make_optimizer`): AdamW's two,
    heavy-ball SGD's one, plain SGD's none."""
    return 2 if optim.kind == "adamw" else (1 if optim.momentum else 0)


@dataclass(frozen=True)
class Spec:
    model: object                       # jaxscale.models.llama.ModelConfig
    degrees: dict = field(default_factory=dict)
    dcn: dict = field(default_factory=dict)
    device_kind: str = "cpu"
    batch: int = 8                      # global batch, sequences
    seq: int = 128
    moments: int = 2                    # optimizer moments per parameter: AdamW 2, SGD 1 or 0
    optim: object = None                # the OptimConfig (the host-side update reads it)
    precision: str = "fp32"
    loss_scale: str = "auto"
    zero: int = 0
    remat: str = "none"
    offload: str = "none"
    offload_tier: str = "host"          # host | nvme (strategies/offload/tiers.py)
    offload_update: str = "device"      # device | host (ZeRO-Offload's host AdamW)
    offload_delay: bool = False         # the host update one step delayed (DPU)
    offload_dir: str = ""               # the nvme tier's directory
    accumulate: int = 1                 # micro-batches per step (pipeline: m)
    grad_sync: str = "auto"             # when data-axis gradients are reduced (strategies/dp)
    donate: bool = True
    context: str = "ring"               # context parallelism over `sp`: ring | ulysses | allgather
    sequence_parallel: bool = False     # Megatron SP: the residual stream split over tp too
    tp_overlap: str = "none"            # collective matmul for TP+SP (strategies/overlap)
    xla_preset: str = "default"         # XLA scheduler options (overlap.XLA_PRESETS)
    schedule: str = "1f1b"              # pipeline schedule when pp > 1
    virtual_stages: int = 1             # virtual stages per device (interleaved)
    stage_layers: str = "auto"          # layers per pipeline stage (strategies/pp/stages.py)
    compression: str = "none"           # gradient compression over dp (strategies/compression)
    compression_block: int = 256
    compression_density: float = 0.01
    compression_threshold: float = 0.0
    compression_rank: int = 4
    local_sgd: str = "none"             # local SGD over dp (strategies/local_sgd)
    local_steps: int = 1                # H: inner steps between averages
    local_warmup: int = 0               # post_local: synchronous steps first
    outer_lr: float = 0.0               # 0: the method's
    outer_momentum: float = -1.0        # -1: the method's
    outer_fragments: int = 1            # Streaming DiLoCo's fragments (local_sgd/fragments.py)
    outer_delay: int = 0                # 1: the average overlaps the next inner step
    outer_mix: float = 0.5              # delayed: the replica's own share in the merge
    prune: str = "none"                 # pruning during training (strategies/prune)
    prune_sparsity: float = 0.5
    prune_start: int = 0
    prune_end: int = 0
    sparse_embedding: bool = False      # sparse embedding-gradient exchange over dp
    qat: str = "none"                   # 8-bit matmuls, quantisation-aware (strategies/quant)
    fp8_amax_history: int = 16          # fp8 delayed scaling's history; 0: current scaling
    moe_dispatch: str = "padded"        # grouped experts' exchange over ep (strategies/ep)
    moe_buffer: float = 2.0             # its bound: f x the balanced share of rows per peer
    zeropp: str = "none"                # ZeRO++ parts: qwz, hpz, qgz '+'-joined (strategies/zeropp)
    zeropp_block: int = 256             # elements per quantisation scale (qwZ, qgZ)
    qgz_bits: int = 4                   # qgZ's gradient bits: 4 or 8
    fp8_param_gather: bool = False      # fp8 QAT: weights gathered in e4m3

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg, n_devices: int | None = None) -> "Spec":
        mesh = cfg.mesh
        if n_devices is not None or any(getattr(mesh, a) == -1 for a in MESH_AXES):
            if n_devices is None:
                raise ValueError("the mesh has a -1 (fill) degree: give the device count "
                                 "(jaxscale plan --devices N)")
            mesh = mesh.resolve(n_devices)          # raises the mesh's own message
        # tensor parallelism splits the vocabulary: pad it to a multiple of tp (as Megatron's
        # make-vocab-size-divisible-by), whatever the vocabulary
        model = replace(cfg.model, vocab_multiple=math.lcm(cfg.model.vocab_multiple,
                                                           max(1, mesh.tp)))
        return cls(model=model, degrees={a: getattr(mesh, a) for a in MESH_AXES},
                   dcn={a: getattr(mesh, f"dcn_{a}", 1) for a in MESH_AXES},
                   device_kind=mesh.device_kind, batch=cfg.data.batch_size,
                   seq=cfg.data.seq_len, moments=moments(cfg.optim), optim=cfg.optim,
                   **{k: getattr(cfg.plan, k) for k in OPTIONS})

    def with_(self, **kw) -> "Spec":
        return replace(self, **kw)

    # ------------------------------------------------------------------ sizes
    @property
    def n_devices(self) -> int:
        return math.prod(self.deg(a) for a in MESH_AXES)

    def deg(self, axis: str) -> int:
        return self.degrees.get(axis, 1)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over (ep carries tokens too: experts live on data ranks)."""
        return tuple(a for a in DATA_AXES if self.deg(a) > 1)

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
    def local_seq(self) -> float:
        return self.seq / self.deg("sp")

    @property
    def layers_per_device(self) -> float:
        """Layers a device runs, averaged over the pipeline's devices (L / pp): the census and
        the FLOPs read from the HLO weigh each stage's branch by its share of the devices."""
        return self.model.n_layers / self.deg("pp")

    @property
    def stored_layers(self) -> int:
        """Rows of the stacked layers each device stores, the padding of uneven stages included
        (`strategies.pp.stages`): what its parameters, and a micro-batch's activations of all
        its chunks, are sized by."""
        from jaxscale.strategies.pp.stages import stored_layers
        return stored_layers(self)

    @property
    def moe(self) -> bool:
        return getattr(self.model, "moe_experts", 0) > 0

    # ------------------------------------------------------------------ precision, as held
    @property
    def param_itemsize(self) -> int:
        """Bytes of the stored working parameters (and of the gradients)."""
        return precision.param_itemsize(self)

    @property
    def compute_itemsize(self) -> int:
        """Bytes of an activation element as the backend's buffers hold it (XLA:CPU holds
        bfloat16 in f32, float16 as it is: `Hardware.held_16bit`)."""
        return self._held(precision.compute_itemsize(self), precision.activation_dtype(self))

    @property
    def held_param_itemsize(self) -> int:
        """Bytes of a parameter or gradient element in a buffer of the step (`param_itemsize`
        as the backend holds it: `compute_itemsize`)."""
        return self._held(self.param_itemsize, precision.param_dtype(self))

    @property
    def wire_compute_itemsize(self) -> int:
        """Bytes per activation element in a collective (f32 on XLA:CPU: `native_16bit`)."""
        return self._wire(precision.compute_itemsize(self))

    @property
    def wire_param_itemsize(self) -> int:
        """Bytes per parameter or gradient element in a collective (f32 on XLA:CPU)."""
        return self._wire(self.param_itemsize)

    def _held(self, size: int, dtype: str) -> int:
        return size if size != 2 or dtype in self.hardware.held_16bit else 4

    def _wire(self, size: int) -> int:
        return size if self.hardware.native_16bit else max(size, 4)

    @property
    def mixed(self) -> bool:
        return precision.mixed(self)

    @property
    def attention(self) -> str:
        """The attention implementation the model resolves to on this hardware
        (`jaxscale.hooks.attention.choose`, the rule the model's `resolve` applies)."""
        if self.model.attention != "auto":
            return self.model.attention
        from jaxscale.hooks.attention import choose
        return choose("auto", self.seq, self.seq, gpu=self.device_kind != "cpu")

    @property
    def hardware(self) -> hardware.Hardware:
        return hardware.get(self.device_kind)

    def cross_node(self, axes) -> bool:
        """Whether a collective over `axes` leaves a node (some axis has a DCN part)."""
        return any(self.dcn.get(a, 1) > 1 for a in axes)

    @functools.cached_property
    def rules(self) -> Rules:
        """The logical->mesh rules of this plan (`rules(spec)`)."""
        return rules(self)

    def label(self) -> str:
        parts = [f"{a}{self.deg(a)}" for a in MESH_AXES if self.deg(a) > 1] or ["single"]
        opts = [o for s in STRATEGIES for o in s.label(self)]
        return "x".join(parts) + (" " + " ".join(opts) if opts else "") + f" {self.precision}"

    # ------------------------------------------------------------------ validation
    def problems(self) -> list[str]:
        return problems(self)

    def validate(self) -> "Spec":
        raise_problems(self.problems(), "plan")
        return self


# ----------------------------------------------------------------------------- composition
def problems(spec: Spec) -> list[str]:
    """Everything that makes the plan impossible, all at once, each naming a fix."""
    errs = []
    try:
        spec.model.validate()
    except ValueError as e:
        errs.append(str(e))
    for a in MESH_AXES:
        if spec.deg(a) < 1:
            errs.append(f"mesh.{a}={spec.deg(a)} must be >= 1")
    if spec.device_kind not in hardware.HARDWARE:
        errs.append(f"unknown hardware {spec.device_kind!r}; valid: {', '.join(hardware.HARDWARE)}")
    if errs:
        return errs
    for s in STRATEGIES:
        errs += s.problems(spec)
    return errs


def unavailable(spec: Spec) -> list[str]:
    """What of this plan `train` cannot run yet, though the planner predicts it (one line each,
    with the fix): strategies not available at all, and the cases a strategy's `runnable(spec)`
    names (its implementation's limits)."""
    out = [s.UNAVAILABLE.format(spec=spec, **spec.degrees) for s in STRATEGIES
           if not s.AVAILABLE and s.active(spec)]
    return out + [e for s in STRATEGIES if hasattr(s, "runnable") for e in s.runnable(spec)]


def branch_share(spec: Spec) -> list | None:
    """How often each branch of the step's `lax.switch` runs per device (`hlo.Module` weighs
    the census and FLOPs by it), from the strategy whose step has one (optional
    `branch_share(spec)`: the pipeline's tick program, local SGD's average every H); with both
    (local SGD's replicas as pipelines) one list each, the outer switch's first (a strategy's
    `SWITCH_OUTER`); None when the step has no such switch."""
    shares = [s.branch_share(spec) for s in sorted(
        STRATEGIES, key=lambda s: not getattr(s, "SWITCH_OUTER", False))
        if hasattr(s, "branch_share") and s.active(spec)]
    return None if not shares else shares[0] if len(shares) == 1 else shares


def rules(spec: Spec) -> Rules:
    r = Rules()
    r.add("batch", spec.data_axes, by="+".join(spec.data_axes) or "replicated")
    for s in STRATEGIES:
        s.rules(spec, r)
    if "layers" not in r.table:
        r.add("layers", None, by="plan")
    return r


def collectives(spec: Spec) -> list:
    """Every collective of one step, per device (`jaxscale.strategies.common.Comm`)."""
    return [c for s in STRATEGIES for c in s.collectives(spec) if c.group > 1 and c.bytes > 0]


def memory_terms(spec: Spec) -> list:
    """The strategies' per-device memory terms (`jaxscale.strategies.common.Term`)."""
    return [t for s in STRATEGIES for t in s.memory(spec)]


def step_parts(spec: Spec) -> StepParts:
    """What the strategies change in the train state and step, each its own `shape_step`, in the
    written order (a part set by two strategies is an error naming both)."""
    parts = StepParts()
    for s in STRATEGIES:
        if hasattr(s, "shape_step"):
            s.shape_step(spec, parts)
    return parts


# ----------------------------------------------------------------------------- the JAX side
@dataclass
class Placement:
    """The device mesh and the logical->mesh rules of a validated plan."""
    spec: Spec
    mesh_cfg: object          # jaxscale.mesh.MeshConfig, degrees resolved
    mesh: object              # jax.sharding.Mesh
    rules: Rules

    def spec_of(self, logical):
        """The mesh PartitionSpec of an array with these logical axis names."""
        return self.rules.spec(logical)

    def sharding(self, logical):
        from jax.sharding import NamedSharding
        return NamedSharding(self.mesh, self.rules.spec(logical))

    def replicated(self):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        return NamedSharding(self.mesh, P())


def validate(cfg, n_devices: int) -> Spec:
    """Resolve the mesh and check the whole config against it; raise one error listing all."""
    import jax

    from jaxscale import config as config_lib
    raise_problems(config_lib.check(cfg))      # every field and relation between fields first
    spec = Spec.from_config(cfg, n_devices)
    errs = unavailable(spec) + problems(spec)
    if jax.process_count() > 1 and cfg.data.batch_size % jax.process_count():
        errs.append(f"data.batch_size={cfg.data.batch_size} is not divisible by the "
                    f"{jax.process_count()} processes")
    raise_problems(errs, "plan")
    return spec


def place(cfg, devices=None) -> Placement:
    import jax

    from jaxscale.mesh import make_mesh
    devices = list(devices if devices is not None else jax.devices())
    spec = validate(cfg, len(devices))
    mesh_cfg = cfg.mesh.resolve(len(devices))
    return Placement(spec, mesh_cfg, make_mesh(mesh_cfg, devices), rules(spec))


