"""The `ps.*` config group: asynchronous training through a parameter server (`jaxscale.ps`)."""
from __future__ import annotations

from dataclasses import dataclass

from jaxscale.fields import nonneg, one_of, positive


@dataclass(frozen=True)
class PsConfig:
    """Asynchronous training through a parameter server (`jaxscale.ps`, `jaxscale launch
    --async`): how the server applies what the workers push."""
    mode: str = one_of("sgd", "sgd", "local")     # push each step's gradients | the parameter
                                      # change after ps.local_steps local steps (async local SGD)
    step_rule: str = one_of("constant", "constant", "staleness", "dc")   # the push's step:
                                      # as is | / (1 + staleness) | delay-compensated (DC-ASGD)
    dc_lambda: float = nonneg(0.04)   # DC-ASGD's variance-control coefficient
    max_staleness: int = nonneg(0, note="0: no bound; a staler push is dropped")
    local_steps: int = positive(8)    # mode=local: local steps between pushes
    outer_lr: float = positive(1.0)   # mode=local: the server adds outer_lr x the change
    barrier: bool = False             # synchronous rounds: the server waits for every
                                      # worker's push and applies their mean (synchronous DP)
    slow: str = ""                    # "worker:factor,...": slow workers down (experiments)

    def slow_factors(self) -> dict[int, float]:
        """{worker: factor} of `slow` ("3:4" makes worker 3 four times slower)."""
        out = {}
        for part in filter(None, (p.strip() for p in self.slow.split(","))):
            worker, _, factor = part.partition(":")
            try:
                w, f = int(worker), float(factor)
            except ValueError:
                raise ValueError(f"ps.slow={self.slow!r}: {part!r} is not worker:factor (e.g. "
                                 f"'3:4' makes worker 3 four times slower)") from None
            if w < 0 or f < 1:
                raise ValueError(f"ps.slow={self.slow!r}: {part!r} needs a worker >= 0 and a "
                                 f"factor >= 1")
            out[w] = f
        return out

    def worker_problems(self, workers: int) -> list[str]:
        """What in the config names a worker a run of `workers` workers does not have."""
        try:
            missing = sorted(w for w in self.slow_factors() if w >= workers)
        except ValueError:
            return []                         # `relations` names it
        if not missing:
            return []
        factors = self.slow_factors()
        have = ("worker 0" if workers == 1 else "workers 0 and 1" if workers == 2 else
                f"workers 0 to {workers - 1}")
        fixed = ",".join(f"{w}:{f:g}" for w, f in factors.items() if w < workers) or \
            f"{workers - 1}:{factors[missing[0]]:g}"
        return [f"ps.slow={self.slow!r} names worker {', '.join(map(str, missing))}, but "
                f"--async {workers} starts only {have}: name those (e.g. ps.slow={fixed!r}), "
                f"or start more workers (--async {missing[-1] + 1})"]

    def relations(self) -> list[str]:
        try:
            self.slow_factors()
        except ValueError as e:
            return [str(e)]
        return []
