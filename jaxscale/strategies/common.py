"""What strategies share: the `Collective` record used for theory and census alike, and sizes."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Collective:
    kind: str                 # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    axes: tuple[str, ...]     # mesh axes the replica groups span
    bytes: float              # per device, per step: the message size (nccl-tests "size")
    count: int = 1
    what: str = ""

    def as_dict(self) -> dict:
        d = asdict(self)
        d["axes"] = list(self.axes)
        return d


def dtype_bytes(dtype: str) -> int:
    return np.dtype(dtype).itemsize
