"""Logical axes, the rules that map them to mesh axes, and `constrain`.

Model code names only logical axes (`batch`, `seq`, `embed`, ...). A plan turns into `Rules`: one
entry per logical axis giving the mesh axes it is sharded over. Strategies add their entries with
`Rules.add`; two strategies claiming the same logical axis is an error that names both, never a
silent first match.

Resolving a tuple of logical names to a `PartitionSpec` drops a mesh axis that an earlier dimension
of the same array already uses: under FSDP the parameter rule `embed -> fsdp` and the activation
rule `batch -> (dp, fsdp)` meet in `x[batch, seq, embed]`, where the batch dimension keeps `fsdp`.

JAX is imported only where arrays are touched (`Rules.spec`, `constrain`), so the plan, the
strategies' formulas and the planner load without it (the CLI sets up simulated devices first).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Iterable, Sequence

#: Mesh axes, outer (slowest link) to inner (fastest link). Nothing else invents axis names.
MESH_AXES = ("dp", "pp", "fsdp", "ep", "sp", "tp")


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one entry of a PartitionSpec (None, an axis, or a tuple of axes)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def mesh_entry(axes: Sequence[str]):
    """The inverse of `entry_axes`: None, one axis, or the tuple (a PartitionSpec entry, or a
    collective's axis name)."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

#: Logical axes the models may use. `seq` is the sequence of the attention and MLP regions;
#: `norm_seq` that of the residual stream and the norms between them (Megatron sequence
#: parallelism splits it over tp where `seq` stays whole; context parallelism splits both over sp).
LOGICAL_AXES = ("batch", "seq", "norm_seq", "embed", "heads", "kv_heads", "head_dim", "mlp",
                "vocab", "layers", "experts")

#: the model's seams (`jaxscale.hooks`), and what a strategy replaces through each
SEAMS = {"context": "attention over a sequence split across devices",
         "projection": "weight matmuls",
         "columns": "weight matmuls that read one input (q, k, v; gate, up)",
         "experts": "mixture-of-experts dispatch",
         "grouped": "the experts' grouped matmuls",
         "gather": "how a weight matmul's sharded weight is gathered and its gradient reduced"}


@dataclass
class Rules:
    """logical axis -> tuple of mesh axes, with the strategy that set each entry."""

    table: dict[str, tuple[str, ...]] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)
    #: the model's seams (`jaxscale.hooks`) -> the implementation a strategy registered for it:
    #: `context` (attention over a sequence split across devices, set by sp), `projection` (the
    #: weight matmuls: collective matmul, QAT), `experts` (a mixture of experts' dispatch, ep)
    seams: dict[str, str] = field(default_factory=dict)
    #: a seam's implementation's settings from the plan (`set_seam(..., **options)`)
    options: dict[str, dict] = field(default_factory=dict)
    #: logical axis -> the mesh axes of its entry that the region being traced runs manual
    #: (taken out by `without`): where a local array's dimension is a piece of a whole one
    manual: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def add(self, logical: str, mesh_axes: str | Sequence[str] | None, by: str) -> "Rules":
        if logical not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {logical!r} (from {by}); "
                             f"valid: {', '.join(LOGICAL_AXES)}")
        axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        for a in axes:
            if a not in MESH_AXES:
                raise ValueError(f"{by} maps {logical!r} to unknown mesh axis {a!r}; "
                                 f"valid: {', '.join(MESH_AXES)}")
        if logical in self.table and self.table[logical] != axes:
            raise ValueError(
                f"conflicting sharding rules for logical axis {logical!r}: {self.owner[logical]} "
                f"maps it to {self.table[logical]}, {by} to {axes}. Remove one of the two "
                f"strategies or give one logical axis to each.")
        self.table[logical] = axes
        self.owner[logical] = by
        return self

    def set_seam(self, seam: str, name: str, by: str, **options) -> "Rules":
        """The model's `seam` runs implementation `name` (with the plan's `options`), for
        strategy `by`; a second strategy setting another one is an error naming both, like two
        rules for one logical axis."""
        if self.seams.get(seam, name) != name:
            raise ValueError(f"{by} and {self.owner[seam + ' seam']} both replace the model's "
                             f"{SEAMS.get(seam, seam)} (the rules' {seam} seam): choose one "
                             f"of them")
        self.seams[seam], self.owner[seam + " seam"] = name, by
        if options:
            self.options[seam] = options
        return self

    def spec(self, names: Iterable[str | None]):
        """The mesh `PartitionSpec` of an array with these logical axis names."""
        from jax.sharding import PartitionSpec as P
        used: set[str] = set()
        out = []
        for n in names:
            axes = tuple(a for a in self.table.get(n, ()) if a not in used) if n else ()
            used.update(axes)
            out.append(mesh_entry(axes))
        return P(*out)

    def as_dict(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self.table.items()}

    def without(self, mesh_axes: Iterable[str]) -> "Rules":
        """These rules with `mesh_axes` taken out of every entry (the seams kept): what the
        arrays of a `shard_map` manual over those axes are laid out by on the other axes."""
        gone = set(mesh_axes)
        manual = {k: self.manual.get(k, ()) + tuple(a for a in v if a in gone)
                  for k, v in self.table.items()}
        return Rules({k: tuple(a for a in v if a not in gone) for k, v in self.table.items()},
                     dict(self.owner), dict(self.seams), dict(self.options),
                     {k: v for k, v in manual.items() if v})


_ACTIVE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "jaxscale_rules", default=None)
_MANUAL: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxscale_manual", default=())
_DIVERGENT: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxscale_divergent",
                                                                  default=False)


@contextlib.contextmanager
def use_rules(mesh, rules: Rules):
    """Make `constrain` shard activations on `mesh` by `rules` while tracing inside the block."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def suspended():
    """No rules while tracing inside the block: the body of a `shard_map`, whose arrays are
    per-device shards that global rules must not constrain."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def manual(mesh_axes: Sequence[str], pieces: bool = True):
    """While tracing the body of a `shard_map` manual over `mesh_axes` (the others left to
    GSPMD): `constrain`, and the model's seams, lay arrays out on the body's mesh (whose
    `mesh_axes` are manual) by the active rules less those axes. A no-op outside `use_rules`.
    `pieces`: the body's arrays are pieces of whole arrays over these axes (a data region's rows,
    a tensor-parallel group's shards), so that a statistic of a whole array combines them
    (`manual_axes`); not so for the pipeline's stages, each running its own layers."""
    ctx = _ACTIVE.get()
    outer = _MANUAL.get()
    held = _MANUAL.set(outer + tuple(a for a in mesh_axes if a not in outer and pieces))
    if ctx is None:
        try:
            yield
        finally:
            _MANUAL.reset(held)
        return
    import jax
    token = _ACTIVE.set((jax.sharding.get_abstract_mesh(), ctx[1].without(mesh_axes)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        _MANUAL.reset(held)


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the code being traced runs manual over (`manual` regions, nested) whose
    devices hold pieces of one array, e.g. to take a statistic over the whole array: a
    per-tensor amax is a max over these axes too (the pipeline's pp is not among them)."""
    return _MANUAL.get()


def active():
    return _ACTIVE.get()


#: the mesh axes that carry the batch (`plan.Spec.data_axes`)
DATA_AXES = ("dp", "fsdp", "ep")


def data_mean(x):
    """The mean of `x` over the data shards of the manual regions being traced (a data region
    manual over dp, say): a statistic of the whole batch where each device holds some rows;
    `x` itself outside them. Its gradient reaches each shard as the whole statistic's."""
    over = tuple(a for a in _MANUAL.get() if a in DATA_AXES)
    if not over:
        return x
    import jax
    return jax.lax.pmean(x, over)


@contextlib.contextmanager
def divergent(on_cpu: bool):
    """While tracing a branch that only some devices take at a time (the pipeline engine's
    per-stage switch), on XLA:CPU when `on_cpu`: `permute` exchanges through an all-to-all.
    XLA:CPU's in-process communicator meets every collective-permute with all the devices its
    source-target pairs name, which in an SPMD program are all of them; devices in another
    branch never arrive (or arrive at another permute, whose data it then swaps). All-reduces,
    gathers and all-to-alls meet their replica groups only, inside the stage. On GPUs a permute
    is NCCL send/recv between its pairs, which the other branches do not disturb."""
    token = _DIVERGENT.set(bool(on_cpu))
    try:
        yield
    finally:
        _DIVERGENT.reset(token)


def permute_as_all_to_all() -> bool:
    """Whether `permute` runs as an all-to-all here (see `divergent`)."""
    return _DIVERGENT.get()


def permute(x, axis_name: str, pairs):
    """`lax.ppermute(x, axis_name, pairs)` of a pytree; inside `divergent` on XLA:CPU the same
    exchange as one all-to-all over the axis: each device puts its value in the slot of its
    target ([n, ...], zeros elsewhere) and keeps the slot its source filled. An axis of 2 moves
    the same bytes either way (its own slot stays); n devices move n - 1 blocks for the one."""
    import jax
    if not _DIVERGENT.get():
        return jax.lax.ppermute(x, axis_name, pairs)
    import jax.numpy as jnp
    import numpy as np
    n = jax.lax.axis_size(axis_name)
    dst, src = np.full(n, -1), np.full(n, -1)
    for s, d in pairs:
        dst[s], src[d] = d, s
    me = jax.lax.axis_index(axis_name)
    to, frm = jnp.asarray(dst)[me], jnp.asarray(src)[me]

    def one(a):
        slots = jnp.zeros((n, *a.shape), a.dtype)
        slots = jax.lax.dynamic_update_index_in_dim(
            slots, jnp.where(to >= 0, a, jnp.zeros_like(a)), jnp.maximum(to, 0), 0)
        got = jax.lax.all_to_all(slots, axis_name, 0, 0)
        out = jax.lax.dynamic_index_in_dim(got, jnp.maximum(frm, 0), 0, keepdims=False)
        return jnp.where(frm >= 0, out, jnp.zeros_like(out))
    return jax.tree.map(one, x)


def on_shards(fn, x, spec):
    """`fn(x)` on each device's own shard of `x`, where `x` is laid out by `spec` (a
    PartitionSpec over the mesh axes GSPMD still handles here) inside a `shard_map` manual over
    some others: XLA's partitioner replicates an array over its GSPMD axes before a manual
    all-gather or psum_scatter, so such a collective runs in a `shard_map` over the remaining
    axes (where `spec` splits nothing, `fn` runs as it is)."""
    if not any(spec):
        return fn(x)
    import jax
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=spec,
                         out_specs=spec, check_vma=False)(x)


def current(mesh, rules: Rules):
    """(mesh, rules) to lay arrays out by while tracing here: the active ones (inside a manual
    region, its mesh and the rules less its axes), else the plan's own."""
    ctx = _ACTIVE.get()
    return (mesh, rules) if ctx is None else ctx


def constrain(x, *names: str | None):
    """Sharding constraint by logical names; a no-op outside `use_rules`."""
    ctx = _ACTIVE.get()
    if ctx is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"constrain got {len(names)} names {names} for an array of shape "
                         f"{x.shape}")
    import jax
    from jax.sharding import NamedSharding
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(names)))
