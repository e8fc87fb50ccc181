r"""Activation checkpointing (rematerialisation) as policies over the model's named activations.

The model tags activations with `checkpoint_name` (`jaxscale.models.llama.TAGS`); each layer's
pure function is wrapped in `jax.checkpoint` with a policy saying, per name, save (keep for the
backward), remat (recompute in the backward) or offload (keep in `pinned_host` memory). The
policies, what each saves and what it recomputes per layer:
- `none`: saves everything the backward needs, recomputes nothing;
- `full`: saves the layer input only, recomputes the whole layer forward;
- `save_dots`: saves the matmul outputs without batch dims (the projections), recomputes the
  norms, activations and attention scores;
- `save_attention_out`: saves the attention output, recomputes everything else;
- `offload`: keeps the projections and the attention output on the host, recomputes the rest;
- a custom `name:save|remat|offload,...`: as given; unnamed tags are rematerialised.

Saves: activations fall to the layer input plus what the policy keeps, per layer; one layer's
activations are rebuilt while its backward runs. Costs: full remat replays each layer's forward
but its last matmul (whose output no backward needs), so block FLOPs grow a little under 4/3
(`jaxscale.planner.perf.recompute_per_token` has the exact replay). Collectives: under TP the
replayed forward repeats the attention-output all-reduce (unless `o_proj` is kept); under FSDP
it gathers the RMSNorm scales again, and shares the weights the backward gathers (see
`strategies/tp`, `fsdp.py`: a region replayed under a policy, `replayed()`, has its weights
gathered before it). Offload adds device<->host copies (PCIe bandwidth) instead of recompute.
"""
from __future__ import annotations

import contextvars
from typing import Callable

from jaxscale.strategies import precision
from jaxscale.strategies.common import Term, problems_of
from jaxscale.strategies.tables import activations as tables

NAME = "remat"
AVAILABLE = True
POLICIES = ("none", "full", "save_dots", "save_attention_out", "offload")
ACTIONS = ("save", "remat", "offload")
#: what `jaxscale plan --search` tries, least memory saved first (the others lie between these)
SEARCHED = ("none", "save_dots", "full")
#: what `save_dots` keeps: the outputs of the weight matmuls (`dots_with_no_batch_dims_saveable`)
SAVE_DOTS = tables.MATMUL_TAGS
#: what `offload` sends to host memory
OFFLOADED = ("q_proj", "k_proj", "v_proj", "attn_out", "o_proj", "mlp_gate", "mlp_up", "mlp_down")


def parse(policy: str) -> dict[str, str] | str:
    """A policy name, or a custom {tag: action} mapping from 'tag:action,...'."""
    from jaxscale.models.llama import TAGS
    if policy in POLICIES:
        return policy
    if policy == "":
        return "none"
    if ":" not in policy:
        raise ValueError(f"unknown plan.remat {policy!r}; valid: {', '.join(POLICIES)}, or a "
                         "custom mapping like 'attn_out:save,mlp_hidden:offload' over the model's "
                         f"tags: {', '.join(TAGS)}")
    mapping = {}
    for item in policy.split(","):
        name, _, action = item.strip().partition(":")
        if name not in TAGS:
            raise ValueError(f"plan.remat names unknown activation {name!r}; the model's tags are: "
                             f"{', '.join(TAGS)}")
        if action not in ACTIONS:
            raise ValueError(f"plan.remat: action {action!r} for {name!r} must be one of "
                             f"{', '.join(ACTIONS)}")
        mapping[name] = action
    return mapping


def actions(policy: str) -> dict[str, str]:
    """tag -> save | remat | offload for every tag (the layer input is always saved)."""
    from jaxscale.models.llama import TAGS
    p = parse(policy)
    if p == "none":
        return {t: "save" for t in TAGS}
    if p == "full":
        return {t: "remat" for t in TAGS}
    if p == "save_dots":
        return {t: "save" if t in SAVE_DOTS else "remat" for t in TAGS}
    if p == "save_attention_out":
        return {t: "save" if t == "attn_out" else "remat" for t in TAGS}
    if p == "offload":
        return {t: "offload" if t in OFFLOADED else "remat" for t in TAGS}
    return {t: p.get(t, "remat") for t in TAGS}


# ----------------------------------------------------------------------------- protocol
def active(spec) -> bool:
    return parse(spec.remat) != "none"


def problems(spec) -> list[str]:
    return problems_of(parse, spec.remat)


def rules(spec, rules) -> None:
    """Remat adds no sharding rule."""


def collectives(spec) -> list:
    """None of its own: the replayed forward's collectives belong to the strategy issuing them."""
    return []


def activations(spec, policy: str | None = None,
                itemsize: int | None = None) -> tables.LayerActivations:
    """One layer's activations per device for one micro-batch of `spec` under a remat policy
    (default: the plan's), from the block's table (`tables.activations`), its compute-dtype
    tensors at `itemsize` bytes (default: as the backend computes them; the table's fp32 ones,
    the scores and statistics, stay 4)."""
    policy = spec.remat if policy is None else policy
    # ring and all-gather context attention run blockwise over the sequence shards: they save
    # the output and its log-sum-exp, not the scores (their hop tiles are `sp.memory`'s)
    blockwise = spec.deg("sp") > 1 and spec.context != "ulysses"
    return tables.layer_activations(
        spec.model, spec.seq, spec.micro_batch * spec.seq, itemsize or spec.compute_itemsize,
        tables.split(spec), None if parse(policy) == "none" else actions(policy),
        "blockwise" if blockwise else spec.attention, tables.experts(spec))


def held(spec) -> tables.LayerActivations:
    """`activations` as the step holds them: as the backend computes them, or under a pipeline
    in the engine's residual slots as the forward returned them, 16-bit tensors at 2 bytes where
    XLA:CPU computes them widened to f32 (the table's fp32 ones, the attention scores and
    statistics, at 4)."""
    if spec.deg("pp") == 1:
        return activations(spec)
    return activations(spec, itemsize=precision.compute_itemsize(spec))


def memory(spec) -> list[Term]:
    """Saved activations of one micro-batch: the layer input plus what the policy keeps (or
    offloads), for the layers of a stage (a pipeline adds the micro-batches in flight: `pp.py`),
    as the step holds them (`held`)."""
    la = activations(spec)
    n = spec.stored_layers
    out = [Term("activations", held(spec).saved * n,
                f"saved for the backward (remat={spec.remat})")]
    if la.host:
        out.append(Term("host", la.host * n, "activations offloaded by the remat policy",
                        part="activations"))
    return out


def label(spec) -> list[str]:
    return [f"remat={spec.remat}"] if active(spec) else []


# ----------------------------------------------------------------------------- the step
def checkpoint_policy(policy: str):
    """The `jax.checkpoint` policy for `policy`, or None for no checkpointing."""
    import jax
    p = parse(policy)
    cp = jax.checkpoint_policies
    if p == "none":
        return None
    if p == "full":
        return cp.nothing_saveable
    if p == "save_dots":
        return cp.dots_with_no_batch_dims_saveable
    if p == "save_attention_out":
        return cp.save_only_these_names("attn_out")
    if p == "offload":
        p = {n: "offload" for n in OFFLOADED}
    save = [n for n, a in p.items() if a == "save"]
    off = [n for n, a in p.items() if a == "offload"]
    if not off:
        return cp.save_only_these_names(*save)
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=save, names_which_can_be_offloaded=off,
        offload_src="device", offload_dst="pinned_host")


def block_wrapper(policy: str) -> Callable | None:
    """What the model applies to each block's pure function: `jax.checkpoint` with the policy,
    tracing the block under `replayed()`."""
    import jax
    if parse(policy) == "none":
        return None
    saved = checkpoint_policy(policy)

    def wrap(f):
        def block(*args, **kw):
            token = _REPLAYED.set(True)
            try:
                return f(*args, **kw)
            finally:
                _REPLAYED.reset(token)
        return jax.checkpoint(block, policy=saved)
    return wrap


_REPLAYED: contextvars.ContextVar = contextvars.ContextVar("jaxscale_remat_replayed",
                                                           default=False)
#: the remat tag of each block weight's matmul output (`jaxscale.models.llama.TAGS`)
SITE_TAG = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
            "w_gate": "mlp_gate", "w_up": "mlp_up", "w_down": "mlp_down"}


def replays(policy: str, sites) -> bool:
    """Whether the policy's replayed forward recomputes any of these sites' matmuls."""
    return parse(policy) != "none" and any(
        actions(policy)[SITE_TAG[s]] == "remat" for s in sites if s in SITE_TAG)


def replayed() -> bool:
    """Whether the code being traced is a block under a remat policy, whose forward the backward
    replays: a region gathering its weights at its entry would gather them once in the replay
    and once more in its transpose (`strategies/tp/columns.py` gathers them before instead)."""
    return _REPLAYED.get()


def shape_step(spec, parts) -> None:
    """The step: every block's pure function wrapped in `jax.checkpoint` with the policy."""
    if active(spec):
        parts.set("block_wrapper", block_wrapper(spec.remat), by=NAME)


# ----------------------------------------------------------------------------- FSDP's gathers
def gathered_before(region, mesh, rules, x_spec, w_specs, w_names):
    """`region(x, scales, *ws)` (a `jax.shard_map` manual over tp whose weights enter split over
    the gather axes, GSPMD gathering them at its entry) with the weights gathered before it,
    where a remat policy replays it (`replayed`): its replay and its transpose are two
    regions, and each would gather the weights at its own entry (the column groups' 5 matmul
    weights of a layer twice in the backward); gathered outside, both read one copy. Inside a
    `jax.checkpoint` of its own, so the copy is recomputed for the backward, never kept.

    The weight gradient is reduced at the gathered layout (all-reduce + slice on XLA:CPU, a
    reduce-scatter on GPUs, the formula's) where the axes it is gathered over are the only
    automatic axes splitting the tokens (`x_spec`); else (dp, ep or sp splitting them too) GSPMD
    reduces it into the weight's own layout. Not under ZeRO++, whose seam gathers each weight
    inside the region, in its own format."""
    import jax
    from jax.sharding import NamedSharding

    from jaxscale.axes import entry_axes
    from jaxscale.hooks import implementation
    if not replayed() or implementation("gather") is not None:
        return region
    kept = {a for s in w_specs for e in s for a in entry_axes(e)}
    gathered = {a for n in w_names for e in rules.spec(n) for a in entry_axes(e)} - kept
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    here = all(a in gathered or mesh.shape[a] == 1 or types[a] == jax.sharding.AxisType.Manual
               for a in {a for e in x_spec for a in entry_axes(e)} - kept)
    shardings = tuple(NamedSharding(mesh, s) for s in w_specs)

    def run(x, scales, *ws):
        return region(x, scales, *(_gather(w, s, here) for w, s in zip(ws, shardings)))
    return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False)


def _gather(w, sharding, reduce_here: bool):
    """`w` laid out as `sharding`; its cotangent constrained to it too (reduced there) or, not
    `reduce_here`, passed on as it is."""
    import jax

    @jax.custom_vjp
    def gather(w):
        return jax.lax.with_sharding_constraint(w, sharding)

    def bwd(_, g):
        return (jax.lax.with_sharding_constraint(g, sharding) if reduce_here else g,)
    gather.defvjp(lambda w: (gather(w), None), bwd)
    return gather(w)
