"""The numerics harness: "this plan computes what one device computes", update by update.

Every test that claims a plan equals one device goes through `assert_matches` (and the
composition check of generated layouts, `jaxscale.analysis.composition`, through `problems`):

- the optimizer takes real steps from the first one (`tiny_config`'s: warm-up 0 and a learning
  rate that stays at `optim.lr`, the decay 1000 steps long), so 3 steps are 3 updates of AdamW,
  and both runs' weights must have moved before anything is compared (`MOVED`);
- at least 3 steps, each on its own batch of the same data stream for both runs;
- at each step it compares the loss, the mean gradients the update read (the train step's
  `with_grads` output: the plan's reduction, compression and ZeRO layout included, no second
  compile) and the updated fp32 weights (the master when the policy keeps one);
- the tolerances (`Tolerance`) come from the method, not from what happened to pass;
- the generated layouts' check (`problems(..., same_weights=True)`) compares each later
  update's gradients with the reference's taken at the plan's own weights (`at_weights`): fp32
  noise in a near-zero gradient turns AdamW's normalised first step by a fraction of lr, and an
  outlier input channel carries that into later gradients (1.5e-5 of a leaf's largest on fsdp2 x
  tp4 with collective matmul, 4e-7 at equal weights), which is the weights' drift, not the plan.

Tolerances. Gradients: max |g - g_ref| over a leaf, relative to max |g_ref| of that leaf.
Parameters: |p - p_ref| in units of the learning rate. AdamW normalises each element's step
(m / sqrt(v)), so a gradient that is a few ulps off can turn an element whose gradient is near
zero by up to 2 lr; the parameter check therefore bounds the largest difference where the
gradients are exact to fp32 rounding, and the mean difference where they carry 16-bit rounding.
A broken plan moves both by whole learning rates (the negative controls in `test_numerics.py`).

- `FP32`: the same fp32 arithmetic in another order: reduction order changes the last bits,
  1e-5 of the leaf's largest gradient bounds it (measured: 4.5e-6 on dp2 x fsdp2 x tp2); losses
  within 1e-5; weights within 2e-2 lr (measured 4.6e-3 lr after 3 updates).
- `BF16`: against one bf16 device: bf16 gradients carry 8 significant bits (2^-8 = 3.9e-3
  relative) and are summed in another order: 3e-2 of the leaf's largest gradient (about 4 ulps;
  measured 1.1e-2); losses within 5e-4 (measured 6e-5); the mean weight difference within
  2e-2 lr (measured 5e-3 lr; a dropped reduction gives about 1 lr).
- `lossy(bound)`: a compressed gradient mean; its per-element error bound from the method
  (`strategies.compression.methods`' table), the losses within the same bound.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import jax
import numpy as np

from jaxscale.analysis.validation import tiny_config
from jaxscale.data import Batches, load_corpus
from jaxscale.train import disk
from jaxscale.train.setup import build

__all__ = ["BF16", "COMPRESSION", "FP32", "MESH_1", "MOE", "MOVED", "PRUNED", "QAT_FP8",
           "QAT_FP8_16BIT", "QAT_INT8", "STEPS", "ZEROPP", "Tolerance", "Trajectory",
           "assert_matches", "combine", "compare", "lossy", "moved", "one_device", "problems",
           "run"]

#: one device: every mesh degree 1
MESH_1 = ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1")

STEPS = 3


@dataclass(frozen=True)
class Tolerance:
    grads: float | None          # max |g - g_ref| / max |g_ref|, per leaf (None: not bounded)
    loss: float                  # |loss - loss_ref| / loss_ref
    params_max: float | None     # max |p - p_ref| / lr (None: not bounded, see `params_mean`)
    params_mean: float           # mean |p - p_ref| / lr
    why: str = ""
    flips: float | None = None   # pruning: the largest share of weights whose masks differ
    grad_steps: int | None = None  # the updates whose gradients are compared (None: every one)
    rounds: bool = False         # quantised operands: rare flips only while the weights agree

    def over(self, steps: int) -> "Tolerance":
        """The bound after `steps` updates. The loss and weight bounds are stated for `STEPS`
        updates; each update's error parts the weights by up to its own bound again, so they
        grow with the updates (linearly here); the gradients' bound is one update's, taken at
        equal weights. Measured: ZeRO++ qwZ+qgZ on dp2 x pp2 x fsdp2 (interleaved, 2 micro-
        batches) against one device, loss 0.0044 and mean weights 0.29 lr after 3 updates,
        0.0107 and 0.52 lr after 6 (local SGD's checks run 6: its first average and a step)."""
        k = max(1.0, steps / STEPS)
        return replace(self, loss=self.loss * k, params_mean=self.params_mean * k,
                       params_max=None if self.params_max is None else self.params_max * k)


FP32 = Tolerance(1e-5, 1e-5, 2e-2, 1e-3, "fp32 in another reduction order")
#: a mixture of experts over ep x tp: each token's output sums its experts' outputs (and the
#: router's gradient its experts' terms) in another order; measured 1.2e-5 on pp2 x ep2 x tp2.
#: The router's top-k is a discrete choice, as a quantised operand's rounding is (`rounds`):
#: beside a lossy source, tokens near a tie change experts once the weights part (ep2 with bf16:
#: the router's gradient 0.52 of its largest off at update 2, within bounds at update 0)
MOE = Tolerance(3e-5, 1e-5, 2e-2, 1e-3, "fp32, the experts' sums in another order",
                rounds=True)
BF16 = Tolerance(3e-2, 5e-4, None, 2e-2, "bf16 gradients: 8 significant bits")


def lossy(bound: float | None, loss: float, why: str) -> Tolerance:
    """A compressed mean whose per-element error is at most `bound` of the leaf's largest
    gradient (the method's error column; None for a low-rank projection, which has no
    per-element bound), and the losses after the updates within `loss`."""
    return Tolerance(bound, loss, None, 0.25, why)


#: the compressed means of `plan.compression`: their bound on one step's gradient error
#: (relative to the leaf's largest gradient), from the method: int8 rounds twice (each device's
#: gradient, then the mean shard) to 1/254 of a block's largest value each, and a device's block
#: max can be a few times the mean's (the devices' gradients partly cancel): 4 x 2/254; bf16
#: twice 2^-9 relative; fp8 e4m3 twice 2^-4 relative. PowerSGD rank r keeps a rank-r projection
#: of each matrix (error feedback carries the rest into later steps): no per-element bound, and
#: AdamW's steps then go elsewhere (the weights are not bounded). The losses after 3 updates:
#: AdamW moves each element by about lr whatever the gradient's size, so a rounding that flips
#: the sign of small gradients changes the step; measured 1.2e-3 (int8) and 1.15e-2 (PowerSGD
#: rank 2, dp8): bounds 5e-3 and 3e-2.
COMPRESSION = {
    "int8": lossy(8 / 254, 5e-3, "int8 blocks, twice rounded"),
    "bf16": lossy(4 * 2 ** -9, 5e-3, "bf16 wire, twice rounded"),
    "fp8": lossy(4 * 2 ** -4, 1e-2, "fp8 e4m3 blocks, twice rounded"),
    "powersgd": Tolerance(None, 3e-2, None, 10.0, "rank-r projection with error feedback"),
}
#: int8 QAT on a parallel plan against one device: the quantised operands are computed from the
#: same values, but an operand moved by fp32 reduction order can round to the neighbouring int8
#: level (1/127 of its row's largest); such flips are rare, so the gradients stay within a
#: fraction of one level: 1/254 (measured 3.9e-4 on dp2 x fsdp2 x tp2).
QAT_INT8 = Tolerance(1 / 254, 1e-4, 0.1, 1e-3, "int8 operands: rare rounding flips",
                     rounds=True)
#: fp8 QAT likewise: the e4m3 / e5m2 operands of the same values with the same per-tensor scales;
#: a flip moves one element by one e4m3 step (2^-3 of it) inside a dot of many: measured 1.9e-4
#: on fsdp2 x tp4 with collective matmul, 9e-4 on dp8 with MoE; bound 2^-6. AdamW's first step
#: moves each weight by lr x sign(g) whatever its gradient's size (m / sqrt(v) = g / |g|), so a
#: gradient nearer zero than a flip's change turns its weight's step around: 2 lr a sign, at
#: most once per update (measured 1.9 on dp8 with MoE, whose experts' gradients, a few tokens
#: each, have many near zero; 3.2 on dp2 x pp2 x tp2 with Megatron SP); the mean by 1e-3.
QAT_FP8 = Tolerance(2 ** -6, 1e-4, 2.0 * STEPS, 1e-3, "fp8 operands: rare rounding flips",
                    rounds=True)
#: fp8 QAT of 16-bit values: the operands it rounds already differ by a 16-bit rounding (another
#: reduction order: 2^-8 relative for bf16, about 1/32 of an e4m3 step), so its roundings flip
#: widely, not rarely: every operand element may be one e4m3 step (2^-3 of it) off, which makes
#: it a lossy source (the compressed means' rule: AdamW's sign flips of small gradients, the
#: weights bounded on average only, the losses within the int8 mean's 5e-3).
QAT_FP8_16BIT = lossy(2 ** -3, 5e-3, "fp8 operands of 16-bit values: one e4m3 step each")


#: ZeRO++ against one device after 3 AdamW updates (`tests/test_zeropp.py` measures each part):
#: qwZ rounds each weight to int8 in blocks (1/254 of a block's largest per weight; the
#: gradients move by a few of those steps, measured 2.9e-2); qgZ rounds each device's partial
#: gradient and each stage's partial sum, int4 to 1/14 of a block's largest, and a device's
#: block max can be a few times the sum's: 4 x 2 roundings, 8/14 (measured 0.10). AdamW moves
#: each weight by ~lr whatever its gradient's size, so int4's sign flips of small gradients move
#: the losses by up to 1e-2 (measured 6.8e-3) and the mean weight by 0.38 lr (bound 0.5).
ZEROPP = {
    "hpz": FP32,
    "qwz": lossy(0.06, 1e-3, "int8 weights in blocks"),
    "qgz": Tolerance(8 / 14, 1e-2, None, 0.5, "int4 gradients, two stages"),
    "qwz+qgz": Tolerance(8 / 14, 1e-2, None, 0.5, "int8 weights, int4 gradients"),
}
#: N:M or magnitude pruning: the mask is recomputed from the weights after every update, so a
#: weight at a near-tie with its group's neighbour can be kept by one run and zeroed by the
#: other (fp32 roundings in another order); that weight then differs by its whole size (about
#: 20 lr measured) and every later gradient by the changed forward. The rule: such flips are
#: rare (at most 1e-3 of the pruned matrices' weights at any step); the weights are compared
#: where both masks agree; after the first flip the runs are two valid trajectories, and only
#: the loss is compared (within the bf16 bound, 5e-4).
PRUNED = Tolerance(1e-5, 5e-4, 2e-2, 1e-3, "pruning: masks recomputed every step", flips=1e-3)


def combine(parts: list[Tolerance]) -> Tolerance:
    """The tolerance of several independent error sources (a compressed mean of bf16 gradients,
    int8 QAT with int8 ZeRO++ gathers): each bound summed; unbounded if any source is."""
    def total(name):
        vals = [getattr(t, name) for t in parts]
        return None if any(v is None for v in vals) else sum(vals)
    flips = [t.flips for t in parts if t.flips is not None]
    lossy_parts = [t for t in parts if t.params_max is None]
    if flips:       # a pair's order flips where its gap is below the runs' weight difference d:
        # gaps spread over the weights' scale (init std 0.02 = 20 lr), so about d / 20 of the
        # pairs; twice that for the other sources' mean bound
        flips = [max(flips) + sum(t.params_mean for t in parts if t.flips is None) / 10]
    # one lossy method's bound holds for each step's mean of the same gradients; with two or
    # more, or one and quantised operands (`rounds`: their rare flips need equal weights), the
    # first update's roundings (AdamW moves each weight by ~lr, its sign theirs) already part
    # the weights by more than one rounding, and the later gradients, taken at those weights,
    # are bounded by the loss and the mean weight difference only
    parted = len(lossy_parts) > 1 or (lossy_parts and any(t.rounds for t in parts))
    return Tolerance(total("grads"), total("loss"), total("params_max"), total("params_mean"),
                     "; ".join(dict.fromkeys(t.why for t in parts if t.why)),
                     flips=flips[0] if flips else None, grad_steps=1 if parted else None,
                     rounds=any(t.rounds for t in parts))


@dataclass
class Trajectory:
    losses: list[float] = field(default_factory=list)
    grads: list = field(default_factory=list)
    params: list = field(default_factory=list)       # fp32 weights after each update
    initial: object = None                            # the fp32 weights before the first
    lr: float = 0.0
    metrics: list = field(default_factory=list)
    text: str = ""               # the compiled step's HLO (with the gradients as an output)
    setup: object = None
    compiled: object = None      # that compiled step (its memory analysis, its outputs' layout)
    batches: object = None       # the batches it ran on (`Batches`: batch i at update i)


def run(overrides, devices=None, steps: int = STEPS, cfg=None) -> Trajectory:
    """`steps` real updates of the tiny model under `overrides` (`--set` strings) on `devices`
    (all 8 by default), each on batch i of one seeded stream."""
    cfg = cfg or tiny_config(*overrides)
    setup = build(cfg, devices, with_grads=True)
    compiled = setup.lower_train_step().compile()
    batches = Batches(load_corpus(cfg.data).train, cfg.data.batch_size, cfg.data.seq_len, seed=0)
    state = setup.init_state()
    out = Trajectory(lr=cfg.optim.lr, text=compiled.as_text(), setup=setup, compiled=compiled,
                     batches=batches)
    out.initial = _weights(state, cfg, setup)
    for i in range(steps):
        state, m = compiled(state, batches.device_batch(i, setup.batch_shardings()))
        m = jax.device_get(m)
        if "grads" in m:        # at the model's true vocabulary, as one device holds it
            m["grads"] = disk.to_disk(m["grads"], cfg.model.vocab_size, setup.layout.layer_order)
        out.losses.append(float(m.pop("loss")))
        out.grads.append(m.pop("grads", None))      # None: a step of its own (local SGD)
        out.metrics.append({k: float(v) for k, v in m.items()})
        out.params.append(_weights(state, cfg, setup))
    return out


def _weights(state, cfg, setup):
    """The fp32 weights (the master when the policy keeps one) in the model's layout."""
    weights = state.master if state.master is not None else state.params
    return jax.tree.map(lambda a: np.asarray(a, np.float32), disk.to_disk(
        jax.device_get(weights), cfg.model.vocab_size, setup.layout.layer_order))


def at_weights(ref: Trajectory, weights, step: int):
    """The gradients `ref`'s step takes at update `step` (its batch) from `weights` (fp32, the
    model's layout: a `Trajectory.params` entry of another run) instead of its own: the other
    run's mean gradients at update `step` are then one computation apart from these, whatever
    AdamW did to the two runs' weights before (its normalised first steps part them where a
    gradient is near zero). Read from `ref`'s compiled step, on a fresh state (the step donates
    it); its optimizer moments do not enter the gradients. None where its state carries more
    into the gradients than the weights (fp8 QAT's histories, a dynamic loss scale, local SGD's
    replicas or a compressor's state): those are `ref`'s own at `step`, not a fresh state's."""
    setup, cfg = ref.setup, ref.setup.cfg
    state, order = setup.init_state(), setup.layout.layer_order
    if any(x is not None for x in (state.quant, state.loss_scale, state.comm)):
        return None

    def placed(like):
        host = jax.tree.map(lambda w, a: np.asarray(w).astype(a.dtype), weights,
                            disk.disk_abstract(like, cfg.model.vocab_size, order))
        return jax.device_put(disk.from_disk(host, like, order),
                              jax.tree.map(lambda a: a.sharding, like))
    state = replace(state, params=placed(state.params), **(
        {} if state.master is None else {"master": placed(state.master)}))
    _, m = ref.compiled(state, ref.batches.device_batch(step, setup.batch_shardings()))
    return disk.to_disk(jax.device_get(m["grads"]), cfg.model.vocab_size, order)


#: the least mean move of the weights, in learning rates, by optimizer: AdamW's first step
#: moves every element whose gradient is not zero by about lr (m / sqrt(v) = sign(g)); SGD
#: moves it by lr x (g + decay x w), on the tiny model about 0.05 lr over 3 updates. A run whose
#: weights moved less did not take a real update (a warm-up from lr 0, a dropped gradient), and
#: comparing it with another proves nothing. (Local SGD shows its anchor, which moves at the
#: replicas' first average: the largest move over the steps counts.)
MOVED = {"adamw": 0.25, "sgd": 1e-3}


def moved(t: Trajectory) -> float:
    """The largest mean |w_t - w_0| over the updates, in learning rates."""
    return max(float(np.concatenate([np.abs(a - b).ravel() for _, a, b in
                                     _leaves(p, t.initial)]).mean() / t.lr) for p in t.params)


def one_device(*overrides, steps: int = STEPS) -> Trajectory:
    """The reference: the same model and options on one device, run once per process for the
    same overrides and steps (many checks compare plans against one reference: read it, never
    change it)."""
    return _one_device(tuple(overrides), steps)


@functools.lru_cache(maxsize=16)
def _one_device(overrides: tuple[str, ...], steps: int) -> Trajectory:
    return run((*overrides, *MESH_1), jax.devices()[:1], steps)


def compare(got: Trajectory, ref: Trajectory, pruned: bool = False,
            grad_steps: int | None = None, same_weights: bool = False) -> dict:
    """The worst differences, step by step, in the units `Tolerance` bounds. `pruned`: the
    weights are compared where both runs' pruning masks agree, and from the step after masks
    first differ only the losses (`PRUNED`); `flips` is the largest share of differing masks.
    `same_weights`: after the first update, the gradients are compared with the reference's
    taken at `got`'s weights (`at_weights`), so that the gradient bound bounds the plan's
    computation alone, not also the drift of the weights between the runs."""
    assert len(got.losses) == len(ref.losses) >= STEPS, "at least 3 updates on each side"
    out = {"loss": 0.0, "grads": 0.0, "params_max": 0.0, "params_mean": 0.0, "where": "",
           "flips": 0.0}
    parted = False                      # the masks differed at an earlier step
    for step, (loss, r) in enumerate(zip(got.losses, ref.losses)):
        out["loss"] = max(out["loss"], abs(loss - r) / abs(r))
        if parted:
            continue
        if got.grads[step] is None or ref.grads[step] is None:
            out["grads"] = None         # local SGD's own step has no mean gradient to show
        compared = out["grads"] is not None and step < (grad_steps or step + 1)
        want = ref.grads[step]
        if compared and same_weights and step:
            want = at_weights(ref, got.params[step - 1], step) or want
        for path, g, gr in _leaves(got.grads[step], want) if compared else ():
            g, gr = np.asarray(g, np.float32), np.asarray(gr, np.float32)
            err = float(np.abs(g - gr).max() / max(np.abs(gr).max(), 1e-30))
            if err > out["grads"]:
                out["grads"], out["where"] = err, f"gradient of {path} at update {step}"
        diffs, flipped, masked = [], 0, 0
        for _, p, pr in _leaves(got.params[step], ref.params[step]):
            keep = np.ones(p.shape, bool)
            if pruned and not np.all(pr):          # a pruned matrix: where the masks agree
                keep = (p == 0) == (pr == 0)
                flipped, masked = flipped + int((~keep).sum()), masked + p.size
            diffs.append(np.abs(p - pr)[keep].ravel())
        flat = np.concatenate(diffs) / ref.lr
        out["params_max"] = max(out["params_max"], float(flat.max()))
        out["params_mean"] = max(out["params_mean"], float(flat.mean()))
        out["flips"] = max(out["flips"], flipped / max(masked, 1))
        parted = flipped > 0
    return out


def problems(got: Trajectory, ref: Trajectory, tol: Tolerance = FP32,
             same_weights: bool = False) -> tuple[list[str], dict]:
    """(what is outside `tol`, the worst differences `compare` found): nothing is compared
    unless both runs' weights moved (`MOVED`)."""
    for side, t in (("the plan", got), ("the reference", ref)):
        m, floor = moved(t), MOVED[t.setup.cfg.optim.kind]
        if m < floor:
            return [f"{side}'s updates moved the weights by {m:.3g} lr on average (at least "
                    f"{floor} expected): nothing was compared"], {}
    d = compare(got, ref, pruned=tol.flips is not None, grad_steps=tol.grad_steps,
                same_weights=same_weights)
    if d["grads"] is None and tol.grads is not None:
        return ["a tolerance on the gradients, but the step shows none"], d
    bad = [f"{k} {d[k]:.3g} > {getattr(tol, k):.3g}"
           for k in ("loss", "grads", "params_max", "params_mean", "flips")
           if getattr(tol, k) is not None and d[k] > getattr(tol, k)]
    return bad, d


def assert_matches(got: Trajectory, ref: Trajectory, tol: Tolerance = FP32) -> dict:
    bad, d = problems(got, ref, tol)
    assert not bad, (f"differs from one device ({tol.why}): {'; '.join(bad)}"
                     + (f" (worst: {d['where']})" if d.get("where") else ""))
    return d


def _leaves(a, b):
    pa = jax.tree_util.tree_flatten_with_path(a)[0]
    pb = jax.tree.leaves(b)
    assert len(pa) == len(pb), "the two runs' trees differ"
    for (path, x), y in zip(pa, pb):
        assert x.shape == y.shape, (jax.tree_util.keystr(path), x.shape, y.shape)
        yield jax.tree_util.keystr(path), x, y
