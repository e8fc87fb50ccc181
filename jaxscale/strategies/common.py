"""What strategies share: the records of a collective, of a memory term and of the step's parts."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 types with numpy)
import numpy as np

from jaxscale.cost import busbw_factor


@dataclass(frozen=True)
class Comm:
    """One collective of a step, per device: a strategy's formula, and what the census reads.

    `bytes` is the message size summed over the `count` executions per step (nccl-tests "size":
    an all-gather's output, a reduce-scatter's input); `group` the devices in each replica group.
    """
    kind: str                 # all-reduce | all-gather | reduce-scatter | all-to-all |
                              # collective-permute
    axes: tuple[str, ...]     # mesh axes the replica groups span
    bytes: float
    count: int = 1
    what: str = ""
    group: int = 1
    optional: bool = False    # XLA may merge it with an identical earlier collective
    cpu_kind: str = ""        # the kind XLA:CPU emits for it, when different
    overlap: bool = False     # can hide under compute (data-parallel traffic, pipeline p2p)
    minimum: float | None = None   # the theoretical minimum bytes, where XLA's program moves more

    @property
    def wire_bytes(self) -> float:
        return self.bytes * busbw_factor(self.kind, self.group) if self.group > 1 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["axes"] = list(self.axes)
        d["wire_bytes"] = self.wire_bytes
        return d


#: rows of the memory ledger: device-resident state, saved activations, the temporaries of the
#: backward, of a strategy's own gradient mean after it (beside the gradients it reads) and of the
#: update phase (the compiled temp is the largest), host-resident bytes, and bytes on disk (the
#: nvme offload tier's files)
ROWS = ("params", "master", "grads", "optimizer", "activations", "backward", "mean", "update",
        "host", "disk")


@dataclass(frozen=True)
class Term:
    """One per-device memory term a strategy adds (negative: it moves bytes elsewhere)."""
    row: str                  # one of ROWS
    bytes: float
    what: str
    part: str = ""            # for host and disk rows: params | master | optimizer |
                              # activations | pieces (a streamed store's pieces in flight)

    def as_dict(self) -> dict:
        return asdict(self)


def permutes(spec, axis: str, nbytes: float, count: int, what: str, minimum=None,
             **kw) -> Comm:
    """The row of `count` collective-permutes over `axis` moving `nbytes` (`minimum`: of them,
    what is needed); on XLA:CPU inside pipeline stages they run as all-to-alls of `axis`-size
    slot buffers (`axes.divergent`), so the row is that all-to-all with the permutes' bytes as
    its minimum."""
    n = spec.deg(axis)
    if spec.device_kind == "cpu" and spec.deg("pp") > 1:
        return Comm("all-to-all", (axis,), nbytes * n, count, what + " (as all-to-alls: XLA:CPU "
                    "inside pipeline stages)", group=n,
                    minimum=nbytes if minimum is None else minimum, **kw)
    return Comm("collective-permute", (axis,), nbytes, count, what, group=n, minimum=minimum,
                **kw)


def problems_of(parse, *args) -> list[str]:
    """A strategy's validation from the parser its step uses: [] when `parse(*args)` accepts,
    else the ValueError's message (which names the field and the valid values)."""
    try:
        parse(*args)
    except ValueError as e:
        return [str(e)]
    return []


def parse_parts(value: str, valid: tuple[str, ...], key: str, example: str,
                every: bool = False) -> frozenset[str]:
    """The parts an option names: "none", parts of `valid` joined with '+', or (`every`) "all";
    an unknown part is an error naming `key`, the valid parts and an `example`."""
    if value in ("", "none"):
        return frozenset()
    if every and value == "all":
        return frozenset(valid)
    parts = frozenset(p.strip() for p in value.split("+"))
    bad = parts - set(valid)
    if bad:
        raise ValueError(f"unknown {key} part(s) {sorted(bad)}; valid: none, "
                         f"{'all, ' if every else ''}or {', '.join(valid)} joined with '+' "
                         f"(e.g. {example})")
    return parts


def block_size(n: int, block: int, even: bool = False) -> int:
    """The block of a row of `n` elements (a shard's last dimension) quantised in blocks of at
    most `block`: ceil(n / block) blocks of equal size, ceil(n / blocks), rounded up to even for
    int4's packed pairs. The row is zero-padded to whole blocks (`zeropp.padded_row`), so every
    length has one: under one element of padding per block (two with int4), and the block is the
    largest divisor of n not above `block` wherever that gives as few blocks (96 over 256: 96;
    384: 192; 509: 255, or 256 for int4, padded to 510 and 512). A block never straddles two
    rows or two shards."""
    if n < 1 or block < 1:
        raise ValueError(f"a quantised row needs n >= 1 elements and block >= 1, got n={n}, "
                         f"block={block}")
    b = -(-n // -(-n // block))
    return b + (b % 2 if even else 0)


def dtype_bytes(dtype: str) -> int:
    return np.dtype(dtype).itemsize


# ----------------------------------------------------------------------------- the step's parts
#: what a strategy may set in `StepParts` (each part by one strategy): who sets it, and what it is
PARTS = {
    "policy": "precision: the `precision.Policy` (dtypes, master weights, loss scaling)",
    "state_specs": "zero: (model specs, shapes, axis sizes, keep) -> `zero.StateSpecs`, the "
                   "mesh specs of each part of the train state",
    "state_keep": "prune: (key path, logical names) -> {dimension: M} a ZeRO split of the "
                  "parameter keeps in whole groups of M (N:M pruning's), or None",
    "memory_kinds": "offload: {part of the train state: the memory kind it lives in between "
                    "steps} for the parts kept in host memory",
    "layer_order": "pp: the stored order of the stacked layers (None: the model's)",
    "state_optimizer": "local_sgd: optimizer -> the one whose state is `TrainState.opt_state`",
    "block_wrapper": "remat: f -> f, applied to each block's pure function",
    "batch_view": "sp: batch -> batch, before the loss (the token layout, true positions)",
    "batch_seq": "sp: the logical axis of the batch's sequence dimension (None: whole)",
    "accumulate": "accumulate: (loss fn, params, batch, combine=None) -> (gradients, aux), "
                  "summed over the micro-batches",
    "micro_batches": "accumulate: how many micro-batches the grads function sums over (1 when "
                     "the data region loops over them itself)",
    "grads": "pp: (model, placement, parts, forward_only=False) -> the grads function (the "
             "other parts it reads: block_wrapper, batch_view, probe)",
    "probe": "qat: a `Probe`, inputs of the model whose cotangents the step reads",
    "reduce": "dp: (grads fn, step context) -> the grads fn run in the data region and reduced "
              "there once per step (`strategies.dp.region`), per-device state in and out",
    "mean": "compression, sparse_embedding: (step context) -> fn(a device's shards of its "
            "gradients, its state, its rows' inputs) -> (their mean over dp, state), in the data "
            "region in place of the exact sum",
    "comm_specs": "compression, local_sgd: (parameter specs, abstract comm state, optimizer) -> "
                  "the mesh specs of `TrainState.comm`",
    "update": "offload: (ctx) -> the optimizer update (streamed through the device)",
    "after_update": "prune: (ctx) -> fn(updated target, updates done) -> target",
    "train_step": "local_sgd, offload: (ctx) -> the whole train step (jitted by the caller, "
                  "unless it is marked `host_driven`: offload's nvme tier and host update)",
}


#: the key of the grads function's statistics that carries a probe's cotangent
PROBE = "probe"


@dataclass(frozen=True)
class Probe:
    """Inputs a strategy adds to the model beside its parameters, differentiated with them so
    that the step reads what the forward and backward saw (fp8 QAT: each layer's scales in, the
    amaxes its matmuls met out, as their cotangent). It lives in `TrainState.<field>`."""
    field: str
    read: Callable            # state part -> the inputs
    wrap: Callable            # loss fn(params, batch) -> fn((params, inputs), batch)
    combine: Callable         # how the micro-batches' cotangents combine (e.g. jnp.maximum)
    write: Callable           # (state part, cotangent, finite) -> the new state part


@dataclass
class StepParts:
    """The parts of the train state and step that a plan's strategies set: each strategy's
    optional `shape_step(spec, parts)`, called in the plan's written order by
    `jaxscale.plan.step_parts`; `jaxscale.train` builds the state and the step from them.

    `PARTS` names each part and the strategy that sets it. Besides: `state` maps a `TrainState`
    field to its initialiser `init(params, optimizer, where)` (`where`: the parameters' mesh
    specs and the mesh's axis sizes; `comm`: laid out by `comm_specs`; `quant`: replicated), set
    as `state.<field>`;
    `compiler_options` are XLA's options for the jitted step. An unset part keeps the plain
    step's behaviour; two strategies setting one part is an error naming both, as two rules for
    one logical axis are."""
    policy: object = None
    state_specs: Callable | None = None
    state_keep: Callable | None = None
    memory_kinds: dict = field(default_factory=dict)
    layer_order: list | None = None
    state_optimizer: Callable | None = None
    block_wrapper: Callable | None = None
    batch_view: Callable | None = None
    batch_seq: str | None = "seq"
    accumulate: Callable | None = None
    micro_batches: int = 1
    grads: Callable | None = None
    probe: Probe | None = None
    reduce: Callable | None = None
    mean: Callable | None = None
    comm_specs: Callable | None = None
    update: Callable | None = None
    after_update: Callable | None = None
    train_step: Callable | None = None
    state: dict = field(default_factory=dict)
    compiler_options: dict = field(default_factory=dict)
    owner: dict = field(default_factory=dict)

    def set(self, part: str, value, by: str) -> "StepParts":
        name = part.split(".", 1)[1] if part.startswith("state.") else None
        if part not in PARTS and name is None:
            raise ValueError(f"{by} sets unknown step part {part!r}; the parts are "
                             f"{', '.join(PARTS)} and state.<field>")
        if part in self.owner:
            raise ValueError(f"{self.owner[part]} and {by} both set the train step's {part!r}: "
                             f"choose one of them")
        self.owner[part] = by
        if name is not None:
            self.state[name] = value
        else:
            setattr(self, part, value)
        return self


def own_mean(spec) -> bool:
    """A strategy computes the gradient mean over dp itself (gradient compression, the sparse
    embedding exchange) in place of the exact sum."""
    return spec.compression != "none" or bool(spec.sparse_embedding)


def split_axes(spec) -> tuple[str, ...]:
    """The data axes that split the parameters (fsdp; dp under ZeRO-3)."""
    out = [a for a in ("dp", "fsdp") if spec.deg(a) > 1 and (a == "fsdp" or spec.zero >= 3)]
    return tuple(out)


def sync_axes(spec) -> tuple[str, ...]:
    """The data axes the step's gradients are reduced over once per step, in the data region
    (`strategies.dp.region`); () when XLA reduces every micro-batch (or there is one
    micro-batch). Read by dp's formulas and by the strategies whose collectives run inside."""
    from jaxscale.axes import MESH_AXES
    if spec.local_sgd != "none":
        return ()           # its own step: the replicas average every H steps
    data = [a for a in ("dp", "fsdp") if spec.deg(a) > 1]
    mode = spec.grad_sync
    axes: set[str] = set()
    if max(1, spec.accumulate) > 1 and mode != "microbatch":
        axes = set(data) if mode == "step" else set(data) - set(split_axes(spec))
    if own_mean(spec) and spec.deg("dp") > 1:
        axes.add("dp")
    return tuple(a for a in MESH_AXES if a in axes)


def manual_data_axes(spec) -> tuple[str, ...]:
    """The data axes the step runs manual over: the data region's (`sync_axes`), or dp under
    local SGD (a replica's own step)."""
    return ("dp",) if spec.local_sgd != "none" else sync_axes(spec)


#: the batch key of the spike guard's loss limit: a replicated fp32 scalar the loop adds to each
#: training batch under `train.spike_policy=skip` (`jaxscale.train.spikes`)
LOSS_LIMIT = "loss_limit"


def accepted(loss, norm, limit=None):
    """(whether the step's update is applied, whether its loss spiked or None): applied when the
    loss and gradient norm are finite and the loss is at most `limit` (a spike: a finite loss
    above it, skipped as a non-finite step is; the loss scale does not shrink for it)."""
    import jax.numpy as jnp
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    if limit is None:
        return finite, None
    spike = finite & (loss > limit)
    return finite & ~spike, spike


def no_overflow(finite, stats):
    """Whether the loss scale may keep growing: the step was finite, or skipped as a spike."""
    return finite | (stats["spike"] > 0) if "spike" in stats else finite


def keep_if_finite(finite, new, old):
    """The new values where the step was finite, else the old ones: a select, for values the
    step computes anyway (the loss scale, error-feedback residuals, a streamed piece of state)."""
    import jax
    import jax.numpy as jnp
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def cast_tree(tree, dtype: str):
    import jax
    return jax.tree.map(lambda x: x.astype(dtype), tree)
