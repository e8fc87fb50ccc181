"""Per-device memory of a training step: model state, activations, temporaries, host offload.

Model state (ZeRO, arXiv 1910.02054, with Psi parameters, N = devices in the ZeRO group):
mixed-precision Adam keeps 2 Psi (16-bit parameters) + 2 Psi (16-bit gradients) + 12 Psi (fp32
master weights, m and v) = 16 Psi bytes; fp32 training 4 + 4 + 8 = 16 Psi. Per device:
DP 16 Psi; ZeRO-1 4 Psi + 12 Psi / N; ZeRO-2 2 Psi + 14 Psi / N; ZeRO-3 16 Psi / N
(`model_states`, exact for the paper's 7.5B / N = 64 example: 120, 31.4, 16.6, 1.9 GB).
On a mesh, the `fsdp` axis shards all three (it is ZeRO-3 over its devices), `tp`/`pp`/`ep`
shard by the logical rules of `params.py`, and `plan.zero` adds the `dp` axis stage by stage.

Activations: `activations.py` per layer x layers per pipeline stage x micro-batches in flight
(1 without pipelining; GPipe m; 1F1B and ZB-H1 min(m, p); interleaved 1F1B min(m, p)
(1 + (p - 1) / (p v)), Korthikanti et al. arXiv 2205.05198 section 4.2.3).

Temporaries are the peak of two phases of the compiled step, as XLA schedules it:
- backward: saved activations + one layer's activations again while its backward runs (their
  gradients; a rematerialised layer's rebuilt forward) + under TP the buffers of the q/k/v
  input-gradient all-reduce (3 bsh) +
  the local gradient buffer + fp32 logits and their gradient + with FSDP one gathered layer of
  weights and that layer's unreduced gradient + with accumulation a gradient accumulator;
- update: the gradients + a copy of the fp32 optimizer state, moments and master weights (XLA
  keeps the old values for the donated, skip-on-non-finite update; read from the buffer
  assignment of `jaxscale inspect`; offloaded state is brought to the device for it) + with
  ZeRO-1 the all-reduced copy of the gradients + with accumulation the fp32 accumulator.
On XLA:CPU activations, gradients and temporaries of 16-bit models are f32-sized
(`Hardware.native_16bit`).
The constants were read from XLA:CPU buffer assignments (jax 0.10); `docs/planner.md` gives the
predicted-vs-compiled table (temp within 15% on every cpu8 plan).

The XLA view (`argument`, `output`, `temp`, `alias`) is what `compiled.memory_analysis()` reports:
arguments are the device-resident state and the batch, outputs the new state (aliased to the
arguments when the state is donated) and the metrics.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from jaxscale.planner import params as params_lib
from jaxscale.planner.activations import LayerActivations, Split, layer_activations

ROWS = ("params", "master", "grads", "optimizer", "activations", "temporaries", "batch")


def model_states(psi: float, n: int, zero: int, mixed: bool = True) -> dict[str, float]:
    """Bytes per device of parameters, gradients, master weights and Adam moments (ZeRO)."""
    pb = 2 if mixed else 4
    return {"params": psi * pb / (n if zero >= 3 else 1),
            "grads": psi * pb / (n if zero >= 2 else 1),
            "master": (psi * 4 / (n if zero >= 1 else 1)) if mixed else 0.0,
            "optimizer": psi * 8 / (n if zero >= 1 else 1)}


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
    xla: dict = field(default_factory=dict)       # argument / output / temp / alias
    layer: dict = field(default_factory=dict)     # per-layer activation tensors (bytes)
    phases: dict = field(default_factory=dict)    # temp of the backward and of the update
    in_flight: float = 1.0

    @property
    def total(self) -> float:
        return sum(getattr(self, r) for r in ROWS)

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    def rows(self) -> dict[str, float]:
        return {r: getattr(self, r) for r in ROWS}

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        d["host_total"] = self.host_total
        return d


def in_flight(spec) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak."""
    p, m = spec.deg("pp"), max(1, spec.accumulate)
    if p == 1:
        return 1.0
    if spec.schedule == "gpipe":
        return float(m)
    base = float(min(m, p))
    if spec.schedule == "interleaved":
        return base * (1 + (p - 1) / (p * spec.virtual))
    return base


def layer_acts(spec) -> LayerActivations:
    split = Split(tp=spec.deg("tp"), sp=spec.deg("sp"), megatron_sp=spec.megatron_sp)
    return layer_activations(spec.model, spec.seq, spec.micro_batch * spec.local_seq,
                             spec.compute_itemsize, split, spec.remat, spec.attention,
                             spec.moe.top_k if spec.moe else 0)


def optimizer_copy(spec, sh) -> float:
    """Bytes of the fp32 optimizer state (moments, master weights) XLA keeps a copy of during
    the donated update; offloaded state is brought to the device for it too."""
    moment_bytes = 4 if spec.mixed else spec.param_itemsize
    return sh.optimizer * (2 * moment_bytes + (4 if spec.mixed else 0))


def estimate(spec) -> Memory:
    m = spec.model
    degrees = dict(spec.degrees)
    sh = params_lib.shards(m, degrees, spec.zero, spec.moe)
    pb, off = spec.param_itemsize, spec.offloaded
    moment_bytes = 4 if spec.mixed else pb
    params = sh.params * pb
    grads = sh.grads * pb
    master = sh.optimizer * 4 if spec.mixed else 0.0
    optimizer = 2 * sh.optimizer * moment_bytes
    tokens = spec.micro_batch * spec.local_seq
    batch = spec.local_batch * spec.local_seq * 12      # inputs, targets (int32), mask (f32)
    counters = 3 * 4                                    # step, Adam count, schedule count

    la = layer_acts(spec)
    stage_layers = spec.stage_layers
    flight = in_flight(spec)
    acts = la.saved * stage_layers * flight

    # ---- temporaries: the larger of the backward and the update phase
    gb = spec.wire_param_itemsize                       # gradients as the backend holds them
    # the stacked gradient buffer: reduced layer by layer inside the layer loop (so kept at its
    # reduced shard) when the weights are fsdp-sharded or under ZeRO-3, else full until the end
    in_loop = spec.deg("fsdp") > 1 or spec.zero >= 3
    local_grads = (sh.grads if in_loop else sh.params) * gb
    full = layer_activations(m, spec.seq, tokens, spec.compute_itemsize,
                             Split(spec.deg("tp"), spec.deg("sp"), spec.megatron_sp), "none",
                             spec.attention, spec.moe.top_k if spec.moe else 0)
    # one layer's activations (their gradients; a rematerialised layer's rebuilt forward) and,
    # under TP, the buffers of the backward's q/k/v input-gradient all-reduce (3 x bsh)
    bsh = tokens * m.dim * spec.compute_itemsize / (spec.deg("tp") if spec.megatron_sp else 1)
    working = full.saved + (3 * bsh if spec.deg("tp") > 1 else 0.0)
    logits = 2 * tokens * m.vocab_size / spec.deg("tp") * 4
    gathered = 0.0
    if spec.deg("fsdp") > 1 or (spec.zero >= 3 and spec.deg("dp") > 1):
        gathered = 2 * sh.gathered_layer * gb     # one layer's weights + its unreduced gradient
    accumulator = sh.params * 4 if spec.accumulate > 1 else 0.0      # fp32
    reduced_copy = local_grads if (spec.zero == 1 and spec.deg("dp") > 1) else 0.0
    backward = local_grads + acts + working + logits + gathered + accumulator
    update = local_grads + accumulator + reduced_copy + optimizer_copy(spec, sh)
    temp = max(backward, update)
    temporaries = temp - grads - acts

    host = {}
    if "optimizer" in off:
        host["optimizer"], optimizer = optimizer, 0.0
    if "master" in off:
        host["master"], master = master, 0.0
    if "params" in off:
        host["params"], params = params, 0.0
    if la.host:
        host["activations"] = la.host * stage_layers * flight

    state = params + master + optimizer + counters
    host_state = sum(v for k, v in host.items() if k != "activations")
    xla = {"argument": state + batch, "output": state + 5 * 4,
           "temp": temp, "alias": state if spec.donate else 0.0,
           "host_argument": host_state, "host_output": host_state}
    xla["total"] = xla["argument"] + xla["output"] + xla["temp"] - xla["alias"]
    if not spec.donate:        # the new state gets buffers of its own next to the old one
        temporaries += state
    return Memory(params=params, master=master, grads=grads, optimizer=optimizer,
                  activations=acts, temporaries=temporaries, batch=batch + counters, host=host,
                  xla=xla, layer=dict(full.tensors), in_flight=flight,
                  phases={"backward": backward, "update": update})
