"""What the compiled train step must not contain: a scatter-add of every token into a small
embedding table, fp32 residual stacks in a 16-bit plan, copies of stacked buffers inside the scan
over layers. Each was a measured cost on the H200 (`../shared/gpu/README.md`)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.analysis import hlo
from jaxscale.models import layers
from jaxscale.train.setup import build
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def bf16_setup():
    return build(tiny_config("plan.precision=bf16", "model.attention=blockwise",
                             "model.n_layers=3"))


@pytest.fixture(scope="module")
def bf16_text(bf16_setup):
    return bf16_setup.lower_train_step().compile().as_text()


def _take_grad(table, tokens, g):
    return jax.vjp(lambda t: jnp.take(t, tokens, axis=0), table)[1](g)[0]


@pytest.mark.parametrize("one_hot_max", [layers.ONE_HOT_MAX_VOCAB, 0])
def test_embedding_gradient_equals_the_scatter_add(monkeypatch, one_hot_max):
    monkeypatch.setattr(layers, "ONE_HOT_MAX_VOCAB", one_hot_max)   # 0: the sorted segment sum
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(50, 8)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 50, (3, 40)), jnp.int32)
    g = jnp.asarray(rng.normal(size=(3, 40, 8)), jnp.float32)
    out, vjp = jax.vjp(lambda t: layers.embed_lookup(t, tokens), table)
    np.testing.assert_array_equal(out, jnp.take(table, tokens, axis=0))
    np.testing.assert_allclose(vjp(g)[0], _take_grad(table, tokens, g), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("one_hot_max", [layers.ONE_HOT_MAX_VOCAB, 0])
def test_embedding_gradient_accumulates_16_bit_gradients_in_fp32(monkeypatch, one_hot_max):
    """4,096 bf16 contributions to one row: summed in bf16 they lose ~2 digits; in fp32 they
    round once, at the end."""
    monkeypatch.setattr(layers, "ONE_HOT_MAX_VOCAB", one_hot_max)
    table = jnp.zeros((4, 16), jnp.bfloat16)
    tokens = jnp.zeros((1, 4096), jnp.int32)
    g = jnp.full((1, 4096, 16), 1.0 + 2 ** -7, jnp.bfloat16)       # exact in bf16
    d = jax.vjp(lambda t: layers.embed_lookup(t, tokens), table)[1](g)[0]
    assert d.dtype == jnp.bfloat16
    exact = jnp.asarray(4096 * (1.0 + 2 ** -7), jnp.bfloat16)
    np.testing.assert_array_equal(d[0], jnp.full((16,), exact))
    np.testing.assert_array_equal(d[1:], 0)


def test_small_vocabulary_takes_no_scatter(bf16_text, bf16_setup):
    """The embedding gradient is a matmul, not a scatter-add of every token into [V, D]."""
    m = bf16_setup.cfg.model
    assert m.vocab_size <= layers.ONE_HOT_MAX_VOCAB
    scatters = [i for i in hlo.Module(bf16_text).instrs if i.opcode == "scatter"]
    into_table = [i for i in scatters if any(d[-1:] == (m.dim,) for _, d in hlo.shapes(i.type_str))]
    assert not into_table, [f"{i.name} {i.type_str}" for i in into_table]
    # the one scatter left is the loss's (-1 at each target's logit, into the logits' gradient)
    assert all(hlo.shapes(i.type_str)[0][1][-1] <= m.vocab_size for i in scatters)


def _scans(jaxpr):
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            yield e
        for p in e.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                yield from _scans(inner)


def test_bf16_plan_saves_no_fp32_residual_stack(bf16_setup):
    """The forward scan's stacked residuals are bf16; fp32 only for per-token statistics (the
    RMSNorm's 1/rms and the attention's log-sum-exp), never a [.., dim] or [.., ffn] stack."""
    s = bf16_setup
    with jax.set_mesh(s.placement.mesh):
        jaxpr = jax.make_jaxpr(s.train_step)(s.abstract_state(), s.abstract_batch()).jaxpr
    L, m = s.cfg.model.n_layers, s.cfg.model
    forward = [e for e in _scans(jaxpr) if e.params["length"] == L
               and e.params["num_carry"] == 1 and len(e.outvars) > 2]
    assert forward, "no scan over the layers with stacked residuals"
    stacks = [v.aval for v in forward[0].outvars[1:]]
    wide = [a for a in stacks if a.dtype == jnp.float32 and a.shape[-1] in (m.dim, m.ffn_dim, m.hd)]
    assert not wide, wide
    assert sum(a.dtype == jnp.bfloat16 for a in stacks) >= 8


def test_scan_body_copies_no_stacked_buffer(bf16_text, bf16_setup):
    """Inside each while body (one layer per trip) the only plain copies are of the carry and the
    trip counter: no stacked weight, gradient or residual ([L, ...]) is copied per layer."""
    L = bf16_setup.cfg.model.n_layers
    module = hlo.Module(bf16_text)
    bodies = {m.group(1).lstrip("%") for m in re.finditer(r"body=(%?[\w.\-]+)", bf16_text)}
    assert len(bodies) >= 2                                   # forward and backward scans
    for name in bodies:
        copies = [i for i in module.instrs if i.computation == name and i.opcode == "copy"]
        stacked = [i for i in copies if any(dims[:1] == (L,) for _, dims in hlo.shapes(i.type_str))]
        assert len(copies) <= 2 and not stacked, (name, [f"{i.name} {i.type_str}" for i in copies])


def test_update_writes_the_donated_state_in_place(bf16_text):
    """The optimizer update reads each old master weight and moment once and overwrites it: no
    copy of any train-state array at the step's entry (the step counter, a scalar, may be). A select
    of new against old for the non-finite guard read the old state again after the update, and XLA
    then copied the master weights and moments at entry (`precision.update_if_finite`)."""
    module = hlo.Module(bf16_text)
    state = {i.name for i in module.instrs if i.computation == module.entry
             and i.opcode == "parameter" and 'op_name="state.' in i.rest
             and hlo.shapes(i.type_str)[0][1]}
    assert len(state) > 20                              # params, moments, master weights
    copied = [i.name for i in module.instrs if i.computation == module.entry
              and i.opcode == "copy" and i.rest.split(")")[0].lstrip("(%") in state]
    assert not copied, copied


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_on_an_fsdp_mesh_moves_no_shard(stage):
    """ZeRO-1/2 split each fsdp shard over dp (('fsdp', 'dp')): the update slices the gradients
    and parameters each device already holds and the gathered parameters land in fsdp's layout,
    so no collective-permute re-lays anything (nested ('dp', 'fsdp'), fp32 ZeRO-1 moved 714 KB
    per step here)."""
    from jaxscale.analysis import inspect
    setup = build(tiny_config("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", f"plan.zero={stage}"))
    specs = jax.tree.leaves(setup.layout.specs.shards,
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert any(("fsdp", "dp") in tuple(s) for s in specs)
    text = setup.lower_train_step().compile().as_text()
    kinds = {c["kind"] for c in inspect.census(text, setup.placement.mesh)}
    assert "all-gather" in kinds and "collective-permute" not in kinds
