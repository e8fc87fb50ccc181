"""Strategies: one small module each, all exposing the same protocol.

Every module reads a `jaxscale.plan.Spec` (the model, mesh degrees, batch, sequence and the
`plan.*` options) and has:

    NAME                         its name in labels and errors
    AVAILABLE                    whether `train` runs it; if not, UNAVAILABLE is the message
                                 (formatted with the mesh degrees and `spec`) and the planner
                                 still predicts it
    active(spec) -> bool         whether the plan uses it
    problems(spec) -> [str]      what makes the plan invalid, each naming the fix
    rules(spec, rules)           the logical->mesh rules it adds (`jaxscale.axes.Rules.add`)
    collectives(spec) -> [Comm]  what it adds per device per step: kind, mesh axes, bytes,
                                 count, why (`common.Comm`)
    memory(spec) -> [Term]       its per-device memory terms (`common.Term`)
    label(spec) -> [str]         how the plan's label names it
    runnable(spec) -> [str]      (optional) what of a valid plan its implementation cannot run
                                 yet: `train` refuses it, the planner predicts it, `--search`
                                 marks it
    branch_share(spec) -> [float] (optional) how often each branch of the `lax.switch` its step
                                 runs is taken per device (`plan.branch_share`: what the census
                                 and FLOPs read from the HLO are weighed by)

and, where it changes the train state or the step, the functions `jaxscale.train` calls:
`precision.policy` / `cast_tree` / loss scaling, `zero.state_specs`, `offload.memory_kind`,
`accumulate.grads`, `remat.block_wrapper`. `jaxscale.plan` composes them in one written order
(`plan.STRATEGIES`) for `train`, `inspect`'s theory and the planner alike. Each docstring says
what the strategy saves, what it costs and which collectives it adds.
"""
