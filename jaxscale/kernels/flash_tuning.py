"""The Pallas FlashAttention kernels' tile sizes and launch settings, and the tuning table that
chooses them per head dim, causality and dtype (`flash_tuning.json` beside this file, rewritten by
`python experiments/gpu_flash_bench.py --tune` on a GPU; `kernels/flash_attention.py` explains
how the kernels use them)."""
from __future__ import annotations

import functools
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxscale.kernels.tiles import BlockSparseMask

KERNELS = ("fwd", "dq", "dkdv")
#: The packaged tuning table, and the environment variable that names another one.
TUNING_TABLE = Path(__file__).with_name("flash_tuning.json")
TUNING_ENV = "JAXSCALE_FLASH_TUNING"


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two >= 16): forward, dK/dV pass and dQ pass. They shrink to the
    sequence length (next power of two) for short sequences."""
    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 64

    def fit(self, T: int, S: int, block_mask: BlockSparseMask | None) -> "BlockSizes":
        tq, tk = max(16, pl.next_power_of_2(T)), max(16, pl.next_power_of_2(S))
        out = {}
        for name, size in self.__dict__.items():
            if size < 16 or size & (size - 1):
                raise ValueError(f"block size {name}={size} must be a power of two >= 16")
            is_q = name.startswith("block_q")
            size = min(size, tq if is_q else tk)
            if block_mask is not None:
                size = math.gcd(size, block_mask.block_q if is_q else block_mask.block_k)
                if size < 16 or size & (size - 1):
                    raise ValueError(f"block-sparse mask blocks ({block_mask.block_q}, "
                                     f"{block_mask.block_k}) must be multiples of 16 for the "
                                     f"Pallas kernel (its tiles are powers of two >= 16)")
            out[name] = size
        return replace(self, **out)


# ----------------------------------------------------------------------------- tuning table
@dataclass(frozen=True)
class KernelConfig:
    """Launch settings of one kernel: its tile (block_q query rows x block_k key rows), warps and
    software-pipelining stages (Triton's num_warps / num_stages)."""
    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class Tuning:
    """Settings of the forward, dQ and dK/dV kernels, and whether dQ is accumulated atomically by
    the dK/dV kernel (no dQ kernel then). `source` says where they came from (not compared)."""
    fwd: KernelConfig
    dq: KernelConfig
    dkdv: KernelConfig
    dq_atomic: bool = False
    source: str = field(default="explicit", compare=False)

    def block_sizes(self) -> BlockSizes:
        return BlockSizes(self.fwd.block_q, self.fwd.block_k, self.dkdv.block_q,
                          self.dkdv.block_k, self.dq.block_q, self.dq.block_k)

    def with_blocks(self, b: BlockSizes) -> "Tuning":
        tiles = {"fwd": (b.block_q, b.block_k), "dq": (b.block_q_dq, b.block_k_dq),
                 "dkdv": (b.block_q_dkv, b.block_k_dkv)}
        return replace(self, **{n: replace(getattr(self, n), block_q=bq, block_k=bk)
                                for n, (bq, bk) in tiles.items()})

    def with_launch(self, num_warps: int | None = None, num_stages: int | None = None) -> "Tuning":
        over = {k: int(v) for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v}
        return replace(self, **{n: replace(getattr(self, n), **over) for n in KERNELS})

    @classmethod
    def from_entry(cls, entry: dict, source: str = "table") -> "Tuning":
        return cls(*(KernelConfig(**entry[n]) for n in KERNELS), bool(entry.get("dq_atomic")),
                   source)

    def to_entry(self) -> dict:
        return {**{n: asdict(getattr(self, n)) for n in KERNELS}, "dq_atomic": self.dq_atomic}


def head_dim_bucket(head_dim: int) -> int:
    """The padded head dim the kernels run at, and the table's key: next power of two, >= 16."""
    return max(16, pl.next_power_of_2(int(head_dim)))


def _fallback(bucket: int) -> Tuning:
    """Used only when no table (or no entry) is found: the settings before the table existed."""
    w = 4 if bucket <= 64 else 8
    return Tuning(KernelConfig(128, 64, w, 3), KernelConfig(128, 64, w, 2),
                  KernelConfig(64, 128, w, 2), source="built-in fallback (no table entry)")


@functools.lru_cache(maxsize=8)
def _read_table(path: str, mtime_ns: int) -> dict:
    with open(path) as fh:
        table = json.load(fh)
    if not isinstance(table.get("entries"), list):
        raise ValueError(f"tuning table {path} has no 'entries' list")
    return table


def load_tuning_table(path: str | os.PathLike | None = None) -> dict:
    """The table at `path`, else at $JAXSCALE_FLASH_TUNING, else the packaged one (re-read when
    the file changes). A missing packaged file gives an empty table (built-in fallback, warned)."""
    p = Path(path or os.environ.get(TUNING_ENV) or TUNING_TABLE)
    if not p.exists():
        if path or os.environ.get(TUNING_ENV):
            raise FileNotFoundError(f"flash attention tuning table {p} not found (named by "
                                    f"{'the path argument' if path else '$' + TUNING_ENV})")
        warnings.warn(f"{p} is missing; Pallas attention uses built-in fallback settings")
        return {"entries": []}
    return _read_table(str(p), p.stat().st_mtime_ns)


def lookup_tuning(head_dim: int, causal: bool, dtype, table: dict | None = None) -> Tuning:
    """The table entry for (head-dim bucket, causal, dtype): exact if present, else the nearest
    (same causality first, then same dtype, then same itemsize, then the closest head dim)."""
    table = load_tuning_table() if table is None else table
    hd, dt = head_dim_bucket(head_dim), jnp.dtype(dtype)

    def distance(e):
        edt = jnp.dtype(e["dtype"])
        return (bool(e["causal"]) != bool(causal),
                0 if edt == dt else 1 if edt.itemsize == dt.itemsize else 2,
                abs(math.log2(e["head_dim"] / hd)), e["head_dim"] > hd)

    if not table["entries"]:
        return _fallback(hd)
    best = min(table["entries"], key=distance)
    d = distance(best)
    near = "" if d[:3] == (False, 0, 0.0) else \
        f" (nearest to d{hd} causal={bool(causal)} {dt.name})"
    return Tuning.from_entry(best, f"table d{best['head_dim']} causal={best['causal']} "
                                   f"{best['dtype']}{near}: {best.get('source', '?')}")


def resolve_tuning(head_dim: int, causal: bool, dtype, *, tuning: Tuning | None = None,
                   block_sizes: BlockSizes | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> Tuning:
    """What a call runs with: `tuning` or the table's entry, then explicit tiles and launch
    settings on top (before the tiles shrink to short sequences)."""
    t = lookup_tuning(head_dim, causal, dtype) if tuning is None else tuning
    if block_sizes is not None:
        t = replace(t.with_blocks(block_sizes), source=f"explicit block_sizes over {t.source}")
    return t.with_launch(num_warps, num_stages)
