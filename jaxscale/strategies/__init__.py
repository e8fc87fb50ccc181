"""Strategies: one module or small package each, all exposing the same protocol.

Every strategy reads a `jaxscale.plan.Spec` (the model, mesh degrees, batch, sequence and the
`plan.*` options) and has:

    NAME                         its name in labels and errors
    AVAILABLE                    whether `train` runs it; if not, UNAVAILABLE is the message
                                 (formatted with the mesh degrees and `spec`) and the planner
                                 still predicts it
    active(spec) -> bool         whether the plan uses it
    problems(spec) -> [str]      what makes the plan invalid, each naming the fix
    rules(spec, rules)           the logical->mesh rules it adds (`jaxscale.axes.Rules.add`), and
                                 the model seams it takes over (`Rules.set_seam`: the
                                 implementation it registered in `jaxscale.hooks`)
    collectives(spec) -> [Comm]  what it adds per device per step: kind, mesh axes, bytes,
                                 count, why (`common.Comm`)
    memory(spec) -> [Term]       its per-device memory terms (`common.Term`)
    label(spec) -> [str]         how the plan's label names it
    shape_step(spec, parts)      (optional) what it changes in the train state and step: the
                                 parts of `common.StepParts` it sets (`common.PARTS` lists them
                                 and who sets each)
    runnable(spec) -> [str]      (optional) what of a valid plan its implementation cannot run
                                 yet: `train` refuses it, the planner predicts it, `--search`
                                 marks it
    branch_share(spec) -> [float] (optional) how often each branch of the `lax.switch` its step
                                 runs is taken per device (`plan.branch_share`: what the census
                                 and FLOPs read from the HLO are weighed by)

`jaxscale.plan` composes them in one written order (`plan.STRATEGIES`) for `train`, `inspect`'s
theory and the planner alike; `jaxscale.train` builds the state and the step from the parts they
set and names none of them. A strategy's module (its package's `__init__`) imports no JAX, so
the plan and the planner load without it; its mechanism (shard_map bodies, kernels, the engine)
is imported where the step is built. Each docstring says what the strategy saves, what it costs
and which collectives it adds. `tables/` holds the model's tables they share: its parameters and
how each weight contracts (`params`), the activations a block keeps (`activations`), weights by
logical name (`weights`).
"""
