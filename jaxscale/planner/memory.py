"""Per-device memory of a training step: model state, activations, temporaries, host offload.

Every strategy contributes its own terms (`memory(spec)` in `jaxscale/strategies/*`, composed by
`jaxscale.plan.memory_terms`); this module adds the model's own and sums them into the rows below.

Model state (`precision.memory`, with ZeRO's shard factors; arXiv 1910.02054, Psi parameters,
N devices in the ZeRO group): mixed-precision Adam keeps 2 Psi (16-bit parameters) + 2 Psi
(16-bit gradients) + 12 Psi (fp32 master weights, m and v) = 16 Psi bytes; fp32 training
4 + 4 + 8 = 16 Psi. Per device: DP 16 Psi; ZeRO-1 4 Psi + 12 Psi / N; ZeRO-2 2 Psi + 14 Psi / N;
ZeRO-3 16 Psi / N (`model_states`, exact for the paper's 7.5B / N = 64 example: 120, 31.4, 16.6,
1.9 GB). Offloaded parts move to host memory, or to disk under the nvme tier with only its
streamed pieces in host memory (`offload.memory`).

Activations (`remat.memory`, `pp.memory`): `tables/activations.py` per layer x layers per pipeline
stage x micro-batches in flight.

Temporaries are the peak of two phases of the compiled step, as XLA schedules it:
- backward: saved activations + the model's terms (the local gradient buffer, one layer's
  activations again while its backward runs: their gradients, a rematerialised layer's rebuilt
  forward; fp32 logits and their gradient; with the gradient stack kept whole until the update,
  a layer's gradients all-reduced inside the layer loop, half the stack on a dense program) +
  the strategies' (TP: the q/k/v input-gradient all-reduce buffers; FSDP: one gathered layer
  and the unreduced gradients XLA holds before scattering them, one weight's, a MoE layer's
  grouped experts', or the layer's under full remat and the zero-bubble schedules' W pass;
  a mixture of experts: its MoE layer's, `ep.memory`; accumulation: the fp32 accumulator);
- mean (a strategy's own gradient mean in the data region, after the backward): the gradient
  buffer it reads + the method's buffers (`compression.memory`: the 8-bit means' fp32 buckets);
- update: the gradient buffer + the strategies' (ZeRO-1: the all-reduced gradients;
  accumulation: the accumulator; host offload: one streamed piece, a layer's state and update,
  `offload.memory`). The update writes the donated state in place (its non-finite guard is a
  `lax.cond`, `train.step.update_if_finite`), so no copy of the state is kept.
On XLA:CPU activations, gradients and temporaries of bfloat16 models are f32-sized, float16's
2 bytes but for the results of collectives, which XLA:CPU computes in f32 (`Hardware.held_16bit`,
`native_16bit`: a layer's all-reduced gradients, FSDP's gathered layer). The constants were
read from XLA:CPU buffer assignments (jax 0.10); `docs/planner.md` gives the predicted-vs-compiled
table (temp within 15% on 56 of the 58 cpu8 plans).

The XLA view (`argument`, `output`, `temp`, `alias`) is what `compiled.memory_analysis()` reports:
arguments are the device-resident state and the batch, outputs the new state (aliased to the
arguments when the state is donated) and the metrics.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from jaxscale import plan as plan_lib
from jaxscale.strategies import pp, remat, zero
from jaxscale.strategies.common import Term
from jaxscale.strategies.offload import tiers
from jaxscale.strategies.zero import STAGE_OF

ROWS = ("params", "master", "grads", "optimizer", "activations", "temporaries", "batch")


def model_states(psi: float, n: int, zero: int, mixed: bool = True) -> dict[str, float]:
    """Bytes per device of parameters, gradients, master weights and Adam moments (ZeRO)."""
    pb = 2 if mixed else 4

    def split(part):
        return n if zero >= STAGE_OF[part] else 1
    return {"params": psi * pb / split("params"), "grads": psi * pb / split("grads"),
            "master": psi * 4 / split("master") if mixed else 0.0,
            "optimizer": psi * 8 / split("optimizer")}


@dataclass
class Memory:
    params: float
    master: float
    grads: float
    optimizer: float
    activations: float
    temporaries: float
    batch: float
    host: dict = field(default_factory=dict)      # what lives in host memory, bytes per device
    disk: dict = field(default_factory=dict)      # what lives on disk (nvme tier), per device
    xla: dict = field(default_factory=dict)       # argument / output / temp / alias
    layer: dict = field(default_factory=dict)     # per-layer activation tensors (bytes)
    phases: dict = field(default_factory=dict)    # temp of the backward and of the update
    in_flight: float = 1.0
    terms: list = field(default_factory=list)     # every term, the model's and the strategies'

    @property
    def total(self) -> float:
        return sum(getattr(self, r) for r in ROWS)

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def disk_total(self) -> float:
        return sum(self.disk.values())

    def rows(self) -> dict[str, float]:
        return {r: getattr(self, r) for r in ROWS}

    def as_dict(self) -> dict:
        d = asdict(self)
        d["terms"] = [t.as_dict() for t in self.terms]
        d["total"] = self.total
        d["host_total"] = self.host_total
        d["disk_total"] = self.disk_total
        return d


def model_terms(spec, full) -> list[Term]:
    """The terms every plan has, whatever its strategies: the gradient buffer, one layer's
    working activations, the fp32 logits and their gradient."""
    grads = zero.grad_buffer(spec)
    tokens = spec.micro_batch * spec.local_seq
    logits = 2 * tokens * spec.model.padded_vocab / spec.deg("tp") * 4
    # kept whole over dp until the update, each layer's gradients are all-reduced into the stack
    # inside the backward loop: one layer's reduced copy beside the stack (dp8, fp32: the compiled
    # temp grows by a layer's gradients and this copy per layer, 2-6 layers; a mixture of experts
    # peaks in its MoE layer: `ep.memory`), as the all-reduce returns it (XLA:CPU reduces a
    # float16 gradient in f32: dp8 fp16, the planner at 0.99 of the compiled temp with it at 4
    # bytes, 0.89 at 2)
    reduced = (zero.grads_whole(spec) and not (spec.moe and spec.model.scan_layers)) \
        * zero.stored_layer_bytes(spec, spec.wire_param_itemsize)
    return [
        Term("backward", reduced, "one layer's gradients all-reduced inside the layer loop"),
        Term("backward", grads, "local gradient buffer"),
        Term("backward", full.saved, "one layer's activations while its backward runs"),
        Term("backward", logits, "fp32 logits and their gradient"),
        Term("backward", attention_tiles(spec), "blockwise attention's backward tiles"),
        Term("update", grads, "local gradient buffer")]


def attention_tiles(spec) -> float:
    """The blockwise attention backward's fp32 working tiles on one device: scores, probabilities
    and their gradients, 4 [micro-batch, heads / tp, b, b] tiles with b = min(512, sequence). Fused
    kernels (pallas, cudnn) keep their tiles on chip, and the `xla` implementation's scores are
    activations (`tables/activations.py`); context parallelism has its own (`sp.memory`)."""
    if spec.attention != "blockwise" or spec.deg("sp") > 1:
        return 0.0
    b = min(512, spec.seq)
    return 4 * spec.micro_batch * spec.model.n_heads / spec.deg("tp") * b * b * 4


def estimate(spec) -> Memory:
    full = remat.activations(spec, "none")   # one layer's activations without remat
    terms = model_terms(spec, full) + plan_lib.memory_terms(spec)
    row = {r: sum(t.bytes for t in terms if t.row == r) for r in
           ("params", "master", "grads", "optimizer", "activations", "backward", "mean",
            "update")}
    host: dict[str, float] = {}
    disk: dict[str, float] = {}
    for t in terms:
        if t.row in ("host", "disk"):
            where = host if t.row == "host" else disk
            where[t.part] = where.get(t.part, 0.0) + t.bytes
    acts = row["activations"]
    batch = spec.local_batch * spec.seq * 12     # inputs, targets (int32), mask (f32): whole
                                                 # along the sequence (sp.batch_seq_axis)
    counters = 3 * 4                            # step, Adam's count, the learning rate's count
    backward = row["backward"] + acts
    mean = row["mean"] + zero.grad_buffer(spec) if row["mean"] else 0.0
    update = row["update"]
    temp = max(backward, mean, update)
    temporaries = temp - row["grads"] - acts
    state = row["params"] + row["master"] + row["optimizer"] + counters
    # the host-driven offload tiers keep their store outside the compiled program
    host_state = 0.0 if tiers.driven(spec) else sum(v for k, v in host.items()
                                                    if k != "activations")
    xla = {"argument": state + batch, "output": state + 5 * 4,
           "temp": temp, "alias": state if spec.donate else 0.0,
           "host_argument": host_state, "host_output": host_state}
    xla["total"] = xla["argument"] + xla["output"] + xla["temp"] - xla["alias"]
    if not spec.donate:        # the new state gets buffers of its own next to the old one
        temporaries += state
    return Memory(params=row["params"], master=row["master"], grads=row["grads"],
                  optimizer=row["optimizer"], activations=acts, temporaries=temporaries,
                  batch=batch + counters, host=host, disk=disk, xla=xla,
                  layer=dict(full.tensors), in_flight=pp.in_flight(spec),
                  phases={"backward": backward, "mean": mean, "update": update}, terms=terms)
