"""The planner: memory, communication, FLOPs and step time of a plan, before compiling anything.

    from jaxscale import planner
    pred = planner.predict(cfg)              # cfg: jaxscale.config.Config
    pred.memory.total, pred.collectives, pred.time.total, pred.time.mfu
    planner.check_fits(cfg, n_devices)       # ValueError naming the largest consumers and fixes
    planner.search.search(cfg, n_devices)    # every valid plan on the mesh, ranked

The plan (`jaxscale.plan.Spec`) and every formula come from the strategy modules
(`jaxscale/strategies/*`: their collectives and memory terms), the same ones `train` builds from
and `inspect` compares against; the planner adds the model's tables and the time model.
Modules: `predict` (a plan's `Prediction`), `memory` (the per-device ledger), `perf` (FLOPs, time,
MFU), `gpt` (the GPT block of the literature), `space` (the options the search crosses: layouts,
precision, ZeRO++, offload rungs), `search` (enumeration, pruning, ranking, what would make a plan
fit), `overrides` (a plan as the `--set` keys of a runnable `jaxscale train` line), `report`
(table, JSON, PNG), `command` (`jaxscale plan`); `jaxscale.analysis.autoplan` compiles the
search's choice (`--plan auto`). The model tables they read
(parameters, activations per layer) are `jaxscale.strategies.tables`; the check against the compiler
is `jaxscale.analysis.validation`.
"""
from jaxscale.planner.predict import Prediction, predict, predict_spec
from jaxscale.planner.search import check_fits

__all__ = ["Prediction", "check_fits", "predict", "predict_spec"]
