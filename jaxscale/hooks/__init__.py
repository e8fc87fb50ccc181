"""The model's seams: the places where a plan changes how the model computes, not what.

The model calls three hooks, each with a plain default and nothing of any strategy in it:

- `attention.attention`: the attention of q, k, v (`models/llama.py`); over a sequence split
  across devices (context parallelism) by the implementation registered under the rules'
  `context` seam;
- `projection.project`: every weight matmul (q, k, v, o, gate, up, down, the LM head); by the
  implementation registered under the rules' `projection` seam (collective matmul, 8-bit QAT);
- `projection.project_columns`: the matmuls that read one input (q, k, v; gate, up), each still
  through `project`; by the implementation registered under the rules' `columns` seam (tensor
  parallelism's: the group in one region, so its input gradient is reduced once);
- `projection.project` also passes every weight through the rules' `gather` seam first, when
  one is named: how the weight arrives whole for its matmul and how its gradient leaves
  (ZeRO++'s quantised and hierarchical gathers and quantised reduction);
- `projection.project` runs a matmul that reads or writes the residual stream (logical
  `norm_seq`: the LM head, the row-parallel o and down) by the implementation registered under
  the rules' `stream` seam, given the local matmul to call (Megatron sequence parallelism's:
  the row matmuls in a region that reduce-scatters to the sequence shards, the head's input
  gathered once);
- `projection.project_grouped`: the experts' grouped matmuls (rows sorted by expert); by the
  implementation registered under the rules' `grouped` seam (8-bit QAT);
- `experts.to_experts` / `from_experts` / `grouped`: a mixture of experts' dispatch of
  tokens to expert slots and back (`models/moe.py`); by the implementation registered under the
  rules' `experts` seam (the sharded dispatch of expert parallelism).

A strategy registers its implementation here under a name (`register`) and names it in its
`rules` (`jaxscale.axes.Rules.set_seam`); while the model is traced under those rules
(`jaxscale.axes.use_rules`), the hook calls it. This module imports no JAX, so the strategies'
protocol modules can register without it.
"""
from __future__ import annotations

from typing import Callable

from jaxscale.axes import active

#: seam -> name -> implementation
SEAMS: dict[str, dict[str, Callable]] = {"context": {}, "projection": {}, "columns": {},
                                          "experts": {}, "grouped": {}, "gather": {},
                                          "stream": {}}


def register(seam: str, name: str):
    """Decorator: `fn` implements `seam` under `name`."""
    if seam not in SEAMS:
        raise ValueError(f"unknown seam {seam!r}; the model's seams are {', '.join(SEAMS)}")

    def deco(fn):
        SEAMS[seam][name] = fn
        return fn
    return deco


def implementation(seam: str):
    """(the registered implementation the active rules name for `seam`, mesh, rules), or None
    outside a plan or when the rules name none."""
    ctx = active()
    name = ctx[1].seams.get(seam) if ctx is not None else None
    if name is None:
        return None
    if name not in SEAMS[seam]:
        raise ValueError(f"the rules name {name!r} for the model's {seam} seam, but nothing is "
                         "registered under it (registered: "
                         f"{', '.join(sorted(SEAMS[seam])) or 'none'}); "
                         f"strategies register when `jaxscale.plan` is imported")
    return SEAMS[seam][name], ctx[0], ctx[1]
