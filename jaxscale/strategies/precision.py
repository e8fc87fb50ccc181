"""Mixed precision: parameter, compute, output and gradient-reduction dtypes; fp32 master weights;
dynamic loss scaling for fp16.

| policy | working params | compute | logits/loss | gradients (and their reduction) | master |
|--------|----------------|---------|-------------|---------------------------------|--------|
| fp32   | fp32           | fp32    | fp32        | fp32                            | -      |
| bf16   | bf16           | bf16    | fp32        | bf16                            | fp32   |
| fp16   | fp16           | fp16    | fp32        | fp16, loss-scaled               | fp32   |

Saves: with Adam, bf16/fp16 hold 2 (params) + 2 (grads) + 4 (master) + 8 (moments) = 16 bytes
per parameter (ZeRO's accounting), fp32 holds 4 + 4 + 8 = 16 as well, but activations and
gradient collectives are half the size in 16-bit. Costs: numerics (loss scaling for fp16).
Collectives: none added; gradient all-reduce / reduce-scatter bytes halve because gradients are
taken with respect to the 16-bit parameters (except the LM head's and the norm scales', whose
products accumulate in f32: 0.544 of fp32 on the tiny model). XLA:CPU widens bf16 all-reduces to f32
after partitioning, so only GPUs show it.

Loss scaling (fp16 only by default): the loss is multiplied by `scale` before differentiation and
gradients divided by it after; a step with a non-finite gradient is skipped (parameters, master
weights and optimizer state untouched) and halves the scale; `growth_interval` finite steps in a
row double it. Small gradients that underflow fp16's 6e-8 without scaling survive with it.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxscale.strategies import zero
from jaxscale.strategies.common import Term, cast_tree, dtype_bytes, problems_of

NAME = "precision"
AVAILABLE = True


@dataclass(frozen=True)
class Policy:
    """The dtypes of a run, whether it keeps fp32 master weights, and its dynamic loss scaling:
    what the step asks of the precision strategy (`StepParts.policy`)."""
    name: str
    param_dtype: str
    compute_dtype: str
    output_dtype: str
    master: bool
    loss_scale: float | None           # initial dynamic scale; None: no scaling
    growth_interval: int = 200

    def working(self, target):
        """The working parameters of an updated target: the fp32 master cast to the 16-bit
        parameter dtype, or the target itself without a master."""
        return cast_tree(target, self.param_dtype) if self.master else target

    def init_loss_scale(self):
        """{"scale", "good_steps"} of dynamic loss scaling, or None without it."""
        import jax.numpy as jnp
        if self.loss_scale is None:
            return None
        return {"scale": jnp.asarray(self.loss_scale, jnp.float32),
                "good_steps": jnp.zeros((), jnp.int32)}

    def next_loss_scale(self, ls, finite):
        """Halve on overflow; double after `growth_interval` finite steps in a row."""
        import jax.numpy as jnp
        if ls is None:
            return None
        good = jnp.where(finite, ls["good_steps"] + 1, 0)
        grow = good >= self.growth_interval
        scale = jnp.where(finite, jnp.where(grow, ls["scale"] * 2.0, ls["scale"]),
                          jnp.maximum(ls["scale"] / 2.0, 1.0))
        return {"scale": scale, "good_steps": jnp.where(grow, 0, good)}


_BASE = {"fp32": ("float32", "float32", False), "bf16": ("bfloat16", "bfloat16", True),
         "fp16": ("float16", "float16", True)}
PRECISIONS = tuple(_BASE)


def policy(plan_cfg) -> Policy:
    """The policy of a `PlanConfig` (or anything with `precision` and `loss_scale`)."""
    name = plan_cfg.precision
    if name not in _BASE:
        raise ValueError(f"unknown plan.precision {name!r}; valid: {', '.join(_BASE)}")
    pd, cd, master = _BASE[name]
    ls = str(plan_cfg.loss_scale).lower()
    if ls == "auto":
        scale = 2.0 ** 15 if name == "fp16" else None
    elif ls == "dynamic":
        scale = 2.0 ** 15
    elif ls == "none":
        scale = None
    else:
        try:
            scale = float(ls)
        except ValueError:
            raise ValueError(f"plan.loss_scale={plan_cfg.loss_scale!r}: give auto, dynamic, none "
                             "or an initial scale (a number)") from None
        if scale <= 0:
            raise ValueError(f"plan.loss_scale must be positive, got {scale}")
    return Policy(name, pd, cd, "float32", master, scale)


# ----------------------------------------------------------------------------- sizes
def compute_dtype(plan) -> str:
    """The dtype the step computes in: the policy's (a `PlanConfig` or a `Spec`)."""
    return _BASE[plan.precision][1]


def mixed(spec) -> bool:
    """16-bit working parameters with fp32 master weights."""
    return _BASE.get(spec.precision, ("", "", False))[2]


def param_dtype(spec) -> str:
    """The dtype of a stored working parameter (and of a gradient)."""
    return _BASE[spec.precision][0] if mixed(spec) else spec.model.param_dtype


def param_itemsize(spec) -> int:
    """Bytes of a stored working parameter (and of a gradient)."""
    return dtype_bytes(param_dtype(spec))


def activation_dtype(spec) -> str:
    """The dtype activations are computed in: the policy's under mixed precision, else the
    model's."""
    return _BASE[spec.precision][1] if mixed(spec) else spec.model.dtype


def cpu_widened(spec) -> tuple[str, ...]:
    """The dtypes the census counts at 4 bytes on XLA:CPU. Its formulas count every 16-bit value
    at 4 bytes there (`Spec.wire_compute_itemsize`: XLA:CPU widens bf16 collectives to f32), but
    XLA:CPU carries float16 ones as they are, and moves some converts across them (norm scales
    and the embedding gathered in f32, their gradients and the head's softmax in f32): under a
    float16 policy its f16 collectives count at 4 bytes too, so that one formula holds on CPU
    for both 16-bit policies (on GPU both are counted as moved). With fp8 QAT too: the e4m3
    operands XLA:CPU widens to f16 then count as the formulas' widened f16 (dp2 x fsdp2 x tp2
    and fsdp4 x tp2 with collective matmul in fp16 + fp8: every row within 0.1%; counted at 2
    bytes, tp and fsdp rows 0.55-0.76 of their formula)."""
    return ("f16",) if activation_dtype(spec) == "float16" else ()


def compute_itemsize(spec) -> int:
    """Bytes of an activation element in the compute dtype (before any backend widening)."""
    return dtype_bytes(activation_dtype(spec))


def state_bytes(spec) -> dict[str, float]:
    """Per-device bytes of the model state with Adam: working parameters, gradients, fp32 master
    weights (16-bit policies) and the optimizer moments (`Spec.moments`; fp32 for 16-bit policies),
    over the elements each part keeps under the plan (`zero.shards`: the rules and ZeRO)."""
    sh = zero.shards(spec)
    pb = param_itemsize(spec)
    return {"params": sh.params * pb, "grads": sh.grads * pb,
            "master": sh.optimizer * 4 if mixed(spec) else 0.0,
            "optimizer": spec.moments * sh.optimizer * (4 if mixed(spec) else pb)}


# ----------------------------------------------------------------------------- protocol
def active(spec) -> bool:
    return spec.precision != "fp32"


def problems(spec) -> list[str]:
    return problems_of(policy, spec)


def rules(spec, rules) -> None:
    """Precision adds no sharding rule."""


def collectives(spec) -> list:
    """None added: gradient collectives carry the parameter dtype (see the module docstring)."""
    return []


def memory(spec) -> list[Term]:
    """The model state: 16 bytes/parameter with Adam either way (2 + 2 + 4 + 8 mixed, 4 + 4 + 8
    fp32), per device as the plan shards it."""
    what = {"params": "working parameters", "grads": "gradients", "master": "fp32 master weights",
            "optimizer": "Adam moments"}
    return [Term(row, b, what[row]) for row, b in state_bytes(spec).items()]


def label(spec) -> list[str]:
    return []      # the plan's label always ends with its precision


def shape_step(spec, parts) -> None:
    """The step: its dtypes, master weights and loss scaling (`Policy`)."""
    parts.set("policy", policy(spec), by=NAME)
