"""Where the offloaded state lives and who updates it: `plan.offload_tier` (host | nvme),
`plan.offload_update` (device | host) and `plan.offload_delay` (ZeRO-Offload's one-step delayed
parameter update); the formulas of the bytes each moves per step and of its time. No JAX here
(the planner reads it).

Tiers, per step (Psi parameters, the state's one logical copy; `Spec.moments` moments):
- host, update on the device (today's `plan.offload`): the parts in `pinned_host` memory, the
  AdamW update streamed through the device a layer at a time (`streaming.py`): every offloaded
  byte crosses the host link twice, per device (`host_link_bytes`).
- host, update on the host (ZeRO-Offload): the fp32 gradients come to the host once (4 Psi
  bytes), the host CPU applies AdamW in numpy (`host_adam.py`) to the moments and fp32 master it
  keeps, and the working parameters go back (param bytes x Psi, to every device that holds a
  copy): (4 + b_param) Psi per step instead of 2 x the offloaded bytes per device, and no device
  memory for the update. With `plan.offload_delay=true` the host's update of step t overlaps the
  forward and backward of step t+1, which then reads the parameters of step t - 1 (one step
  stale: the gradient of step s >= 1 is taken at the parameters after s - 1 updates; step 0's
  at the initial ones; a checkpoint waits for the update in flight, so the step after a save
  or a resume reads current parameters, as step 0 does).
- nvme (ZeRO-Infinity's tier): the same parts in files under `plan.offload_dir` (`store.py`),
  streamed a piece at a time with one piece of read-ahead: every stored byte is read once and
  written once per step (`disk_bytes`), whichever side updates; host RAM holds at most a few
  pieces. The update runs on the device per piece (the link moves each piece in and out) or on
  the host (the link moves gradients in and parameters out, as above).

Collectives: none added (disk and PCIe transfers are charged by the planner's time model,
`seconds`). Saves: the host tier saves device memory, the nvme tier host memory too; the cost
is link and disk time, hidden only by read-ahead and (with the delay) by the next step's compute.
"""
from __future__ import annotations

from jaxscale.strategies import precision, zero
from jaxscale.strategies.tables.params import leaves

TIERS = ("host", "nvme")
UPDATES = ("device", "host")


def driven(spec) -> bool:
    """Whether the step is driven from the host (a Python loop over pieces, `driver.py`), not
    one jitted program: the nvme tier or the host update."""
    return spec.offload not in ("", "none") and (spec.offload_tier == "nvme"
                                                 or spec.offload_update == "host")


def parts_offloaded(spec) -> frozenset:
    return frozenset() if spec.offload in ("", "none") else frozenset(spec.offload.split("+"))


def problems(spec) -> list[str]:
    """Combinations no implementation could run, and (nvme) the directory, before anything is
    written: it must exist, take a file, and have room for `store_bytes`."""
    errs = []
    off = parts_offloaded(spec)
    for key, on in (("offload_tier", spec.offload_tier == "nvme"),
                    ("offload_update", spec.offload_update == "host"),
                    ("offload_delay", spec.offload_delay)):
        if on and not off:
            errs.append(f"plan.{key}={getattr(spec, key)} but plan.offload=none offloads nothing "
                        f"to place or update: set plan.offload=optimizer+master (or optimizer "
                        f"under fp32)")
    if spec.offload_delay and spec.offload_update != "host":
        errs.append("plan.offload_delay=true overlaps the host's update with the next step's "
                    "forward and backward; with plan.offload_update=device the update runs on "
                    "the device between them, so there is nothing to overlap: set "
                    "plan.offload_update=host")
    if spec.offload_update == "host" and spec.moments != 2:
        errs.append("plan.offload_update=host runs AdamW on the host CPU; optim.kind=sgd has no "
                    "host update: set optim.kind=adamw or plan.offload_update=device")
    if not errs and spec.offload_tier == "nvme" and off:
        from jaxscale.strategies.offload import store
        err = store.probe(spec.offload_dir, store_bytes(spec))
        errs += [err] if err else []
    return errs


def runnable(spec) -> list[str]:
    """The host-driven step's limits (what it does not implement; the planner still predicts)."""
    if not driven(spec):
        return []
    want = {"optimizer", "master"} if spec.mixed else {"optimizer"}
    out = []
    if parts_offloaded(spec) != want:
        out.append(f"plan.offload_tier={spec.offload_tier} / plan.offload_update="
                   f"{spec.offload_update} move the optimizer moments and the fp32 master "
                   f"together and keep the working parameters on the device: set plan.offload="
                   f"{'+'.join(sorted(want, reverse=True))}")
    for what, on in (("mesh.pp > 1", spec.deg("pp") > 1), ("plan.qat", spec.qat != "none"),
                     ("plan.prune", spec.prune != "none"),
                     ("plan.local_sgd", spec.local_sgd != "none")):
        if on:
            out.append(f"the host-driven offload step (plan.offload_tier=nvme or "
                       f"plan.offload_update=host) does not run with {what}: use "
                       f"plan.offload_tier=host with plan.offload_update=device")
    return out


# ----------------------------------------------------------------------------- formulas
def psi(spec) -> int:
    """Parameters as the state stores them (the vocabulary padded)."""
    return int(sum(leaf.size for leaf in leaves(spec.model)))


def counters(spec) -> int:
    """int32 step counters in the optimizer state: AdamW's count and the schedule's; SGD's."""
    return 2 if spec.moments == 2 else 1


def store_bytes(spec) -> int:
    """Bytes of the nvme store, one logical copy: the moments (fp32 under 16-bit policies, else
    the parameters' dtype), the fp32 master (16-bit policies) and the optimizer's counters."""
    moment = 4 if spec.mixed else spec.param_itemsize
    per = spec.moments * moment + (4 if spec.mixed else 0)
    return psi(spec) * per + 4 * counters(spec)


def store_parts(spec) -> dict[str, float]:
    """`store_bytes` by part (the counters with the optimizer's): one logical copy for the
    whole process, whatever the plan's sharding of the state on the devices."""
    moment = 4 if spec.mixed else spec.param_itemsize
    parts = {"optimizer": float(psi(spec) * spec.moments * moment + 4 * counters(spec)),
             "master": float(psi(spec) * 4) if spec.mixed else 0.0}
    return {k: v for k, v in parts.items() if k in parts_offloaded(spec)}


#: pieces of the store in host RAM at once while it streams (`store.Store.stream`): the one
#: read ahead, the one being updated and its new values, and the previous one's being written
PIECES_IN_FLIGHT = 4


def piece_elems(spec) -> float:
    """Parameters in the largest piece of the store: a layer of every stacked leaf, or the
    largest unstacked leaf (embedding or head)."""
    ls = leaves(spec.model)
    layer = sum(leaf.size for leaf in ls if leaf.stacked) / spec.model.n_layers
    return float(max(layer, max((leaf.size for leaf in ls if not leaf.stacked), default=0)))


def host_ram_bytes(spec) -> dict[str, float]:
    """Host RAM of the host-driven tiers, the whole process: the store (the host tier with the
    host update keeps its one logical copy in RAM; nvme only `PIECES_IN_FLIGHT` pieces of it)
    and, for the host update, a piece's fp32 gradients and the new working parameters (they go
    to the devices whole after the last piece)."""
    per = (store_bytes(spec) - 4 * counters(spec)) / psi(spec)
    out = ({"pieces": PIECES_IN_FLIGHT * per * piece_elems(spec)}
           if spec.offload_tier == "nvme" else dict(store_parts(spec)))
    if spec.offload_update == "host":
        out["params"] = float(spec.param_itemsize * psi(spec))
        out["pieces"] = out.get("pieces", 0.0) + 4 * piece_elems(spec)
    return out


def disk_bytes(spec) -> dict[str, int]:
    """Bytes read from and written to the store per (finite) step: each stored byte once each
    way; 0 off the nvme tier. A skipped (non-finite) step reads and writes nothing."""
    n = store_bytes(spec) if spec.offload_tier == "nvme" and driven(spec) else 0
    return {"read": n, "written": n}


def host_link_bytes(spec) -> dict[str, float]:
    """Bytes over the host link per step, all devices of the process together: "in" to the
    host, "out" to the devices. The update on the device moves each device's offloaded state
    both ways (nvme: out to every device's copy, back as one copy); on the host, the fp32
    gradients come once and the working parameters go to every device holding a copy."""
    n = spec.n_devices
    if spec.offload in ("", "none"):
        return {"in": 0.0, "out": 0.0}
    sh = zero.shards(spec)
    if spec.offload_update == "host":
        if not driven(spec):
            return {"in": 0.0, "out": 0.0}
        params_out = spec.param_itemsize * sh.params * n
        target_in = 0 if spec.mixed else 4 * psi(spec)     # fp32: the parameters are the target
        return {"in": 4.0 * psi(spec) + target_in, "out": float(params_out)}
    state = precision.state_bytes(spec)
    per_device = sum(state[p] for p in parts_offloaded(spec))
    if spec.offload_tier == "nvme":
        return {"in": float(store_bytes(spec) - 4 * counters(spec)), "out": per_device * n}
    return {"in": per_device * n, "out": per_device * n}


def seconds(spec, compute: float) -> dict[str, float]:
    """The offload's time per step on `spec.hardware`, per device: host link (`host_bw`), disk
    (`disk_bw`, the node's NVMe shared by its devices) and the host's AdamW
    (`host_update_rate` parameters/s per device); "exposed" is what the step waits for.
    Read-ahead pipelines disk and link, so the streamed part costs the slower of the two; the
    delayed update hides the host's part (link + AdamW) behind the next step's `compute`."""
    hw = spec.hardware
    n = spec.n_devices
    link = sum(host_link_bytes(spec).values()) / n / hw.host_bw
    disk = sum(disk_bytes(spec).values()) / n / hw.disk_bw
    host = psi(spec) / n / hw.host_update_rate if spec.offload_update == "host" and driven(
        spec) else 0.0
    stream = max(link, disk) + host
    exposed = max(0.0, stream - compute) if spec.offload_delay else stream
    return {"link": link, "disk": disk, "host_update": host, "exposed": exposed}
