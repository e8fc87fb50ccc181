"""Sequence and context parallelism: Megatron SP over `tp`, context parallelism over `sp`.

Not available in `train` yet: the planner predicts these plans and `--search` marks them.

Megatron sequence parallelism (`plan.sequence_parallel`, arXiv 2205.05198) saves the residual
stream's activation memory t-fold: the norm and residual regions are split on `seq` over tp
(`jaxscale.planner.activations.split`), at no extra cost in bytes: each TP all-reduce becomes a
reduce-scatter plus an all-gather collective of the same total (`tp.py` counts them).

Context parallelism over `sp` (`plan.context`) saves activations sp-fold: every token-indexed
activation is split sp ways (the attention scores keep their full key length). Its cost is
collectives on the critical path, per layer and micro-batch:
- `ring` (Ring Attention): K/V blocks pass around the ring, (sp - 1) collective-permutes of the
  local K/V block forward, twice that backward (K/V again and their gradients);
- `ulysses` (DeepSpeed-Ulysses): all-to-alls from sequence- to head-sharded q, k, v and back for
  the output, forward and backward (per-link volume 4Nh/P); sp must divide the kv heads per tp
  rank;
- `allgather`: K/V all-gathered forward, their gradients reduce-scattered backward.
The weight gradients are reduced over sp as over a data axis (`dp.py`).
"""
from __future__ import annotations

from jaxscale.strategies.common import Comm

NAME = "sp"
AVAILABLE = False
UNAVAILABLE = ("sequence and context parallelism (mesh.sp={sp}, plan.sequence_parallel) are not "
               "available yet: set mesh.sp=1 and plan.sequence_parallel=false, and give the "
               "devices to dp, fsdp or tp")
CONTEXTS = ("ring", "ulysses", "allgather")


def active(spec) -> bool:
    return spec.deg("sp") > 1 or spec.sequence_parallel


def problems(spec) -> list[str]:
    m, sp, t, errs = spec.model, spec.deg("sp"), spec.deg("tp"), []
    if sp > 1:
        if spec.seq % sp:
            errs.append(f"data.seq_len={spec.seq} is not divisible by mesh.sp={sp}")
        if spec.context not in CONTEXTS:
            errs.append(f"plan.context={spec.context!r}: valid are {', '.join(CONTEXTS)}")
        if spec.context == "ulysses" and ((m.n_heads // t) % sp or (m.n_kv_heads // t) % sp):
            errs.append(f"Ulysses attention redistributes heads: the {m.n_heads // t} query and "
                        f"{m.n_kv_heads // t} kv heads per tp rank must be divisible by "
                        f"mesh.sp={sp} (use plan.context=ring)")
    if spec.sequence_parallel and spec.seq % t:
        errs.append(f"Megatron sequence parallelism splits data.seq_len={spec.seq} over "
                    f"mesh.tp={t}: it must divide")
    return errs


def rules(spec, rules) -> None:
    if spec.deg("sp") > 1:
        rules.add("seq", "sp", by="sp")


def collectives(spec) -> list[Comm]:
    sp = spec.deg("sp")
    if sp == 1:
        return []
    m, k, t = spec.model, max(1, spec.accumulate), spec.deg("tp")
    L = spec.stage_layers
    tokens = spec.micro_batch * spec.local_seq
    beta = spec.compute_itemsize
    kv = 2 * tokens * m.n_kv_heads * m.hd / t * beta          # the local K and V blocks
    if spec.context == "ring":
        steps = 3 * (sp - 1) * L * k
        return [Comm("collective-permute", ("sp",), kv * steps, int(steps),
                     "ring attention: K/V blocks forward, K/V and dK/dV backward", group=sp)]
    if spec.context == "allgather":
        return [Comm("all-gather", ("sp",), kv * sp * L * k, int(L * k),
                     "K/V gathered over the sequence, forward", group=sp),
                Comm("reduce-scatter", ("sp",), kv * sp * L * k, int(L * k),
                     "dK/dV reduced to their sequence shards, backward", group=sp)]
    qkvo = tokens * (2 * m.n_heads + 2 * m.n_kv_heads) * m.hd / t * beta
    return [Comm("all-to-all", ("sp",), 2 * qkvo * L * k, int(8 * L * k),
                 "Ulysses: q, k, v, out forward and backward", group=sp)]


def memory(spec) -> list:
    """None of its own: the activation split is in the per-layer table (`activations.split`)."""
    return []


def label(spec) -> list[str]:
    out = [spec.context] if spec.deg("sp") > 1 else []
    return out + (["megatron-sp"] if spec.sequence_parallel else [])
