"""What strategies share: the records of a collective and of a memory term, and sizes."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 types with numpy)
import numpy as np

from jaxscale.cost import busbw_factor


@dataclass(frozen=True)
class Comm:
    """One collective of a step, per device: a strategy's formula, and what the census reads.

    `bytes` is the message size summed over the `count` executions per step (nccl-tests "size":
    an all-gather's output, a reduce-scatter's input); `group` the devices in each replica group.
    """
    kind: str                 # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
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
#: backward and of the update phase (the compiled temp is the larger), and host-resident bytes
ROWS = ("params", "master", "grads", "optimizer", "activations", "backward", "update", "host")


@dataclass(frozen=True)
class Term:
    """One per-device memory term a strategy adds (negative: it moves bytes elsewhere)."""
    row: str                  # one of ROWS
    bytes: float
    what: str
    part: str = ""            # for host rows: params | master | optimizer | activations

    def as_dict(self) -> dict:
        return asdict(self)


def problems_of(parse, *args) -> list[str]:
    """A strategy's validation from the parser its step uses: [] when `parse(*args)` accepts,
    else the ValueError's message (which names the field and the valid values)."""
    try:
        parse(*args)
    except ValueError as e:
        return [str(e)]
    return []


def dtype_bytes(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def dp_only(spec, option: str, why: str, off: str) -> list[str]:
    """The error of a strategy that runs over `dp` alone when the plan splits the model over
    another mesh axis: `option` (e.g. "plan.compression") names it, `why` the reason, `off`
    the setting that turns it off."""
    other = [f"mesh.{a}={spec.deg(a)}" for a in ("pp", "fsdp", "ep", "sp", "tp") if spec.deg(a) > 1]
    if not other:
        return []
    return [f"{option} runs on data-parallel plans over mesh.dp alone, not with "
            f"{', '.join(other)}{': ' + why if why else ''}; set them to 1 or {off}"]

