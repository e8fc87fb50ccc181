"""How Ulysses attention spreads one device's heads over the sp shards, any head count.

Ulysses' all-to-all hands shard r of sp a group of heads for the whole sequence. When sp divides
the device's q heads H and kv heads K, shard r takes q heads [r H/sp, (r+1) H/sp) and their
K/sp kv heads. Otherwise the heads are padded, never split unevenly (an all-to-all moves equal
blocks): shard r takes nq = ceil(H / sp) q slots, q heads [r nq, (r+1) nq) and zero heads past
H, and nk kv slots holding the kv heads its q heads read, a kv head that two shards' q heads
share sent to both. The q slots are grouped into nk runs of nq / nk consecutive slots that read
one kv slot (grouped-query attention again), nk the least divisor of nq for which every shard's
runs each read one kv head: K / sp when sp divides both, at most nq (one kv slot per q slot).

The padding costs the all-to-alls' bytes (sp nq q slots and sp nk kv slots in place of H and K)
and attention FLOPs (nq heads a shard instead of H / sp); a zero q head attends uniformly and
its output is dropped on the way back, so its gradient is zero. Plain Python: the formulas read
the same slots as the code (`ulysses_slots`).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Slots:
    """One device's heads over sp shards: `q[r]` / `kv[r]` are the q / kv heads shard r receives,
    one per slot (-1: a zero head), `nq` / `nk` the slots a shard gets."""
    heads: int
    kv_heads: int
    sp: int
    nq: int
    nk: int
    q: tuple[tuple[int, ...], ...]
    kv: tuple[tuple[int, ...], ...]

    @property
    def padded(self) -> bool:
        """Whether the slots differ from the heads in order (sp divides neither count, or a kv
        head goes to two shards)."""
        return (self.q_send != tuple(range(self.heads))
                or self.kv_send != tuple(range(self.kv_heads)))

    @property
    def q_send(self) -> tuple[int, ...]:
        """The q heads in send order (sp nq slots), -1 for a zero head."""
        return sum(self.q, ())

    @property
    def kv_send(self) -> tuple[int, ...]:
        return sum(self.kv, ())

    @property
    def q_back(self) -> tuple[int, ...]:
        """For each q head, its slot in send order (where its output comes back)."""
        where = {h: i for i, h in enumerate(self.q_send) if h >= 0}
        return tuple(where[h] for h in range(len(where)))


def ulysses_slots(n_heads: int, n_kv_heads: int, sp: int) -> Slots:
    """The slots of `n_heads` q heads and `n_kv_heads` kv heads on one device (grouped-query:
    q head i reads kv head i // (n_heads / n_kv_heads)) over `sp` shards (see the module)."""
    if n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"Ulysses attention needs q heads a multiple of the kv heads, got "
                         f"{n_heads} and {n_kv_heads}")
    group = n_heads // n_kv_heads
    nq = -(-n_heads // sp)
    q = tuple(tuple(h if h < n_heads else -1 for h in range(r * nq, (r + 1) * nq))
              for r in range(sp))
    for nk in (d for d in range(1, nq + 1) if nq % d == 0):
        run = nq // nk
        kv, ok = [], True
        for heads in q:
            mine = []
            for j in range(nk):
                read = {h // group for h in heads[j * run:(j + 1) * run] if h >= 0}
                if len(read) > 1:
                    ok = False
                    break
                mine.append(read.pop() if read else -1)
            if not ok:
                break
            kv.append(tuple(mine))
        if ok:
            return Slots(n_heads, n_kv_heads, sp, nq, nk, q, tuple(kv))
    raise AssertionError("unreachable: nk = nq always fits")      # pragma: no cover


def exchanged_heads(n_heads: int, n_kv_heads: int, sp: int,
                    real: bool = False) -> tuple[int, int]:
    """(q slots, kv slots) one device sends per token in each all-to-all direction: sp nq and
    sp nk (n_heads and n_kv_heads when sp divides both). `real`: the slots holding a head, not
    a zero one (n_heads, and the kv heads each shard reads: the least an exchange of whole heads
    could move)."""
    s = ulysses_slots(n_heads, n_kv_heads, sp)
    if real:
        return n_heads, sum(h >= 0 for h in s.kv_send)
    return sp * s.nq, sp * s.nk
