"""Host offload of train state: optimizer moments, fp32 master weights and/or working parameters
resident in host memory (`pinned_host` memory kind), brought to the device inside the step.

Memory: device-resident state falls by exactly the offloaded bytes (Adam moments alone are 8 of
the 16 bytes/param). Cost: every step copies the offloaded state to the device and the updated
state back, 2 x offloaded bytes over PCIe (~25 GB/s per GPU, vs ~4 TB/s HBM): the planner's
step-time model charges it. Collectives: none added. Activation offload goes through the remat
policy (`plan.remat=offload`), not here.
"""
from __future__ import annotations

from jaxscale.strategies.common import Term, problems_of

NAME = "offload"
AVAILABLE = True
PARTS = ("optimizer", "master", "params")
HOST = "pinned_host"


def parse(spec: str) -> frozenset[str]:
    if spec in ("", "none"):
        return frozenset()
    parts = frozenset(p.strip() for p in spec.split("+"))
    bad = parts - set(PARTS)
    if bad:
        raise ValueError(f"unknown plan.offload part(s) {sorted(bad)}; valid: none, or "
                         f"{', '.join(PARTS)} joined with '+' (e.g. optimizer+master)")
    return parts


def memory_kind(part: str, parts: frozenset[str]) -> str | None:
    """Where a part of the train state lives between steps: host memory when offloaded."""
    return HOST if part in parts else None


def move(tree, shardings, parts: frozenset[str]):
    """Inside the step: `tree` to `shardings` (device memory on the way in, its home memory kind
    on the way out); nothing to do when nothing is offloaded."""
    if tree is None or not parts:
        return tree
    import jax
    return jax.device_put(tree, shardings)


# ----------------------------------------------------------------------------- protocol
def active(spec) -> bool:
    return not problems(spec) and bool(parse(spec.offload))


def problems(spec) -> list[str]:
    errs = problems_of(parse, spec.offload)
    if errs:
        return errs
    if "master" in parse(spec.offload) and not spec.mixed:
        return [f"plan.offload includes 'master' but plan.precision={spec.precision} keeps no "
                f"separate fp32 master weights; offload 'params' or 'optimizer', or use bf16/fp16"]
    return []


def rules(spec, rules) -> None:
    """Offload adds no sharding rule (the state keeps its shardings, in host memory)."""


def collectives(spec) -> list:
    """None: the device<->host copies are PCIe transfers, charged by the planner's time model."""
    return []


def memory(spec) -> list[Term]:
    """Each offloaded part leaves device memory for host memory, byte for byte."""
    if not active(spec):
        return []
    from jaxscale.strategies.precision import state_bytes
    state = state_bytes(spec)
    out = []
    for part in PARTS:
        if part in parse(spec.offload):
            out += [Term(part, -state[part], f"{part} offloaded to host memory"),
                    Term("host", state[part], f"{part} in host memory", part=part)]
    return out


def label(spec) -> list[str]:
    return [f"offload={spec.offload}"] if active(spec) else []
