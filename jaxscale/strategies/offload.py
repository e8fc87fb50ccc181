"""Host offload of train state: optimizer moments, fp32 master weights and/or working parameters
resident in host memory (`pinned_host` memory kind), brought to the device inside the step.

Memory: device-resident state falls by exactly the offloaded bytes (Adam moments alone are 8 of
the 16 bytes/param). Cost: every step copies the offloaded state to the device and the updated
state back, 2 x offloaded bytes over PCIe (~25 GB/s per GPU, vs ~4 TB/s HBM): the planner's
step-time model charges it. Collectives: none added. Activation offload goes through the remat
policy (`plan.remat=offload`), not here.
"""
from __future__ import annotations

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


def validate(plan_cfg, has_master: bool) -> list[str]:
    try:
        parts = parse(plan_cfg.offload)
    except ValueError as e:
        return [str(e)]
    if "master" in parts and not has_master:
        return [f"plan.offload includes 'master' but plan.precision={plan_cfg.precision} keeps no "
                f"separate fp32 master weights; offload 'params' or 'optimizer', or use bf16/fp16"]
    return []
