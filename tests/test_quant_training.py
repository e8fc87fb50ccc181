"""Quantisation-aware training as a plan option (`plan.qat`, strategies/qat/):
8-bit dots in the compiled program, straight-through gradients, fp8 delayed scaling's state,
int8 under a parallel plan against one device, fp8's saved-activation memory, refusals."""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale import plan as plan_lib
from jaxscale.analysis import hlo, inspect
from jaxscale.config import check
from jaxscale.data import Batches, load_corpus
from jaxscale.plan import Spec
from jaxscale.strategies import qat
from jaxscale.strategies.qat import numerics
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train.setup import build
from tests import numerics as harness
from tests.helpers import MESH_1, tiny_config

STEPS = 4
MIX = ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2")


def dot_operands(text: str) -> collections.Counter:
    """(lhs dtype, rhs dtype, result dtype) of every dot, times its loop trip count."""
    mod = hlo.Module(text)
    out = collections.Counter()
    for ins in mod.instrs:
        if ins.opcode == "dot":
            ops = mod.operand_shapes(ins)
            out[(ops[0][0][0], ops[1][0][0], hlo.shapes(ins.type_str)[0][0])] += \
                mod.runs.get(ins.computation, 0)
    return out


class Run:
    """A plan compiled once; `steps` runs it on the same batches for every plan."""

    def __init__(self, *overrides, one_device=True):
        self.cfg = tiny_config(*overrides, "plan.check_memory=false")
        self.setup = build(self.cfg, devices=jax.devices()[:1] if one_device else None)
        self.lowered = self.setup.lower_train_step()
        self.compiled = self.lowered.compile()
        self.text = self.compiled.as_text()

    def steps(self, batches, initial, n=STEPS):
        """n steps from `initial` (host arrays: one initialisation for every plan, placed by
        this plan's shardings), with fp8's histories zeroed."""
        fresh = qat.init_state(Spec.from_config(self.cfg, self.setup.placement.mesh.size))
        state = jax.device_put(dataclasses.replace(initial, quant=fresh),
                               self.setup.state_shardings)
        losses, states = [], []
        for i in range(n):
            state, m = self.compiled(state, batches.device_batch(i, self.setup.batch_shardings()))
            losses.append(float(m["loss"]))
            states.append(jax.device_get(state.quant))
        self.last = state
        return losses, states


@pytest.fixture(scope="module")
def batches():
    cfg = tiny_config()
    corpus = load_corpus(cfg.data)
    return Batches(corpus.train, cfg.data.batch_size, cfg.data.seq_len, seed=0,
                   pad_id=corpus.pad_id)


@pytest.fixture(scope="module")
def int8_one():
    return Run(*MESH_1, "plan.qat=int8")


@pytest.fixture(scope="module")
def initial(int8_one):
    return jax.device_get(int8_one.setup.init_state())


@pytest.fixture(scope="module")
def fp8_one():
    return Run(*MESH_1, "plan.qat=fp8", "plan.fp8_amax_history=3")


# ------------------------------------------------------------------------------------------
# the compiled program
# ------------------------------------------------------------------------------------------
def test_int8_compiles_to_s8_dots(int8_one):
    dots = dot_operands(int8_one.text)
    L = int8_one.cfg.model.n_layers
    assert dots[("s8", "s8", "s32")] == 7 * L           # the seven block matmuls, forward
    assert not any("f8" in k[0] for k in dots)
    assert dots[("f32", "f32", "f32")] > 0              # head, attention, STE backward


def test_fp8_dots_in_the_program(fp8_one):
    """XLA:CPU widens fp8 dots to f32 after optimisation; the program it is given has them."""
    pre = dot_operands(fp8_one.lowered.as_text(dialect="hlo"))   # layer loop bodies once:
    e4, e5 = "f8e4m3fn", "f8e5m2"                       # no trip counts before optimisation
    assert pre[(e4, e4, "f32")] == 7                    # forward: e4m3 x e4m3
    assert pre[(e5, e4, "f32")] == 7                    # dx = g(e5m2) . w(e4m3)
    assert pre[(e4, e5, "f32")] == 7                    # dw = x(e4m3) . g(e5m2)
    assert "f8e4m3fn" in fp8_one.text                  # the casts survive compilation


# ------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------
def test_fp8_trains_and_rolls_its_amax_history(fp8_one, batches, initial, tmp_path):
    losses, states = fp8_one.steps(batches, initial)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses
    L, H = fp8_one.cfg.model.n_layers, 3
    hist = [s["amax_history"] for s in states]
    assert hist[0].shape == (L, len(numerics.SLOTS), H)
    for i, h in enumerate(hist):               # step i+1 filled i+1 columns (at most H)
        filled = min(i + 1, H)
        assert np.all(h[..., :filled] > 0), i
        assert np.all(h[..., filled:] == 0), i
    np.testing.assert_array_equal(hist[1][..., 1], hist[0][..., 0])    # rolled, not rewritten
    np.testing.assert_array_equal(hist[3][..., 1:], hist[2][..., :2])
    assert not np.array_equal(hist[3][..., 0], hist[2][..., 0])          # a new amax each step
    g = [numerics.SLOTS.index(f"g:{s}") for s in numerics.SITES]
    x = [numerics.SLOTS.index(f"x:{s}") for s in ("attn_in", "mlp_in")]
    assert hist[-1][..., g, 0].max() < 0.1 < hist[-1][..., x, 0].min()   # gradients are small
    # the histories are saved and restored with the rest of the train state
    abstract = fp8_one.setup.abstract_state()
    assert abstract.quant["amax_history"].shape == (L, len(numerics.SLOTS), H)
    ck = ckpt_lib.Checkpointer(tmp_path / "ck", fp8_one.cfg.ckpt)
    ck.save(STEPS, fp8_one.last, ckpt_meta.make_meta(fp8_one.cfg, fp8_one.last, STEPS))
    ck.wait()
    restored = ck.restore(STEPS, abstract)
    ck.close()
    np.testing.assert_array_equal(restored.quant["amax_history"], hist[-1])


def test_fp8_records_the_largest_amax_over_micro_batches(fp8_one, batches, initial):
    """With plan.accumulate=2 a step's amaxes are the larger of the two micro-batches' (what a
    scale must cover), not their mean: each micro-batch run alone (its rows twice, so the batch
    size is the same) gives the same x and w amaxes as it does inside the accumulated step."""
    acc = Run(*MESH_1, "plan.qat=fp8", "plan.fp8_amax_history=3", "plan.accumulate=2")
    rows = batches.global_rows(0)
    micro = [{k: np.concatenate([v[j::2]] * 2) for k, v in rows.items()} for j in (0, 1)]

    def newest(run, host_batch):
        fresh = qat.init_state(Spec.from_config(run.cfg, 1))
        state = jax.device_put(dataclasses.replace(initial, quant=fresh),
                               run.setup.state_shardings)
        batch = jax.device_put(host_batch, run.setup.batch_shardings())
        quant = jax.device_get(run.compiled(state, batch)[0].quant)
        return np.asarray(quant["amax_history"])[..., 0]
    fwd = [i for i, s in enumerate(numerics.SLOTS) if s[0] in "xw"]
    both = newest(acc, rows)[:, fwd]
    alone = [newest(fp8_one, m)[:, fwd] for m in micro]
    assert not np.allclose(alone[0], alone[1], rtol=1e-3)       # the micro-batches differ
    np.testing.assert_allclose(both, np.maximum(*alone), rtol=1e-5)


def test_int8_parallel_plan_matches_one_device():
    """Straight-through int8 on dp2 x fsdp2 x tp2 against one device, 3 updates: per-token
    scales are taken over the whole contracted axis either way (`tests/numerics.py`'s
    QAT_INT8); the census equals the formula row by row (it was 0.71 of it on the fsdp
    gathers, which XLA chose to make in 8 bits)."""
    mix = harness.run((*MIX, "plan.qat=int8"))
    harness.assert_matches(mix, harness.one_device("plan.qat=int8"), harness.QAT_INT8)
    assert dot_operands(mix.text)[("s8", "s8", "s32")] > 0
    # the forward gathers FSDP weights as int8; row-parallel partial sums travel as s32
    gathers = [i for i in hlo.Module(mix.text).instrs if i.opcode.startswith("all-gather")]
    reduces = [i for i in hlo.Module(mix.text).instrs if i.opcode.startswith("all-reduce")]
    assert any(i.type_str.startswith("s8[") for i in gathers)
    assert any(i.type_str.startswith("s32[") for i in reduces)
    # the per-token scale reductions over tp are in the census, at least the theory's bytes
    spec = Spec.from_config(mix.setup.cfg, 8)
    theory = [c for c in plan_lib.collectives(spec) if "QAT" in c.what]
    assert theory and theory[0].axes == ("tp",)
    census = {(r["kind"], tuple(r["axes"])): r for r in
              inspect.census(mix.text, mix.setup.placement.mesh)}
    assert census[("all-reduce", ("tp",))]["bytes"] >= theory[0].bytes
    # every row is the formula's: fsdp's gathers per weight (int8 forward, fp32 backward),
    # the scales' reductions over fsdp and tp (`qat.weight_gathers`, `qat.collectives`)
    for r in inspect.theory_vs_census(plan_lib.collectives(spec), list(census.values())):
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=1e-4, abs=8), r


# ------------------------------------------------------------------------------------------
# numerics of one matmul: straight-through gradients, fp8's amax cotangent
# ------------------------------------------------------------------------------------------
EQS = ("btd,dhk->bthk", "bthk,hkd->btd", "btf,fd->btd")


def operands(eq, seed=0):
    ins = eq.split("->")[0].split(",")
    sizes = dict(b=2, t=8, d=32, h=4, k=8, f=48)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=[sizes[c] for c in ins[0]]).astype(np.float32))
    w = jnp.asarray(0.05 * rng.normal(size=[sizes[c] for c in ins[1]]).astype(np.float32))
    g = jnp.asarray(rng.normal(size=jnp.einsum(eq, x, w).shape).astype(np.float32))
    return x, w, g


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@jax.jit
def one_matmul(x, w, g, tight):
    """For each einsum: the reference, int8 and fp8 outputs and gradients (fp8 from no history,
    with the amaxes it reports), and fp8 with a too-small delayed x scale."""
    out = []
    for eq, (a, b, c) in zip(EQS, zip(x, w, g)):
        ref, ref_vjp = jax.vjp(lambda u, v: numerics.reference(eq, u, v), a, b)
        i8, i8_vjp = jax.vjp(lambda u, v: numerics.int8_matmul(eq, u, v), a, b)
        f8, f8_vjp = jax.vjp(lambda u, v, s: numerics.fp8_matmul(eq, u, v, s), a, b,
                             jnp.zeros((3,), jnp.float32))
        sat = numerics.fp8_matmul(eq, a, b, jnp.stack([jnp.abs(a).max() / 448 * tight, 0.0, 0.0]))
        out.append((ref, ref_vjp(c), i8, i8_vjp(c), f8, f8_vjp(c), sat))
    return out


def test_one_matmul_int8_straight_through_fp8_close_and_amaxes():
    ops = [operands(eq, i) for i, eq in enumerate(EQS)]
    res = one_matmul(*zip(*ops), 0.25)
    for eq, (x, w, g), (ref, (rx, rw), i8, i8_grads, f8, (dx, dw, ds), sat) in zip(EQS, ops, res):
        assert 1e-4 < rel(i8, ref) < 0.02, eq             # quantised, within int8's error
        for got, want in zip(i8_grads, (rx, rw)):         # the unquantised matmul's gradients
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert 1e-4 < rel(f8, ref) < 0.06, eq             # e4m3: 3 mantissa bits
        assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))
        assert rel(dx, rx) < 0.15 and rel(dw, rw) < 0.15  # e5m2 gradients: 2 mantissa bits
        np.testing.assert_allclose(ds, [jnp.abs(x).max(), jnp.abs(w).max(), jnp.abs(g).max()],
                                   rtol=1e-6)             # the amaxes, as the scales' cotangent
        # a delayed x scale 4x too small saturates at e4m3's 448 (no inf, no nan)
        assert np.all(np.isfinite(sat)) and rel(sat, ref) > rel(f8, ref), eq


# ------------------------------------------------------------------------------------------
# memory and the planner's terms
# ------------------------------------------------------------------------------------------
def test_fp8_saved_inputs_memory_against_compiled(int8_one, fp8_one):
    """int8 keeps the unquantised operands for its straight-through backward (the same as
    without QAT, no term); fp8 keeps the four matmul inputs in e4m3: the planner's negative
    activation term against the compiled temp bytes (int8's program as the reference). XLA:CPU's
    heap packing moves the difference by up to a third either way (1.33x of the term now; the
    live-set peaks of the two programs differ by 0.63x of it)."""
    spec8, spec = (Spec.from_config(r.cfg, 1) for r in (int8_one, fp8_one))
    assert qat.memory(spec8) == []
    terms = {t.what: t.bytes for t in qat.memory(spec)}
    L, H = spec.model.n_layers, spec.fp8_amax_history
    assert terms["fp8 amax histories"] == 4 * L * 18 * H
    predicted = -terms["matmul inputs saved in e4m3 instead of the compute dtype"]
    assert predicted == 3 * 8 * 32 * (2 * 128 + 128 + 384) * L
    measured = (int8_one.compiled.memory_analysis().temp_size_in_bytes
                - fp8_one.compiled.memory_analysis().temp_size_in_bytes)
    assert 0.6 * predicted < measured < 1.4 * predicted, (measured, predicted)
    arg = (fp8_one.compiled.memory_analysis().argument_size_in_bytes
           - int8_one.compiled.memory_analysis().argument_size_in_bytes)
    assert arg == terms["fp8 amax histories"]


# ------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------
def test_refusals():
    errs = check(tiny_config(*MESH_1, "plan.qat=int4"))
    assert any("plan.qat" in e and "int8" in e for e in errs), errs
    assert any("fp8_amax_history" in e for e in check(tiny_config("plan.fp8_amax_history=-1")))

    def problems(*ov):
        return qat.problems(Spec.from_config(tiny_config(*ov), 8))
    assert problems("plan.qat=int8") == []
    assert problems("plan.qat=fp8", "mesh.dp=1", "mesh.pp=2") == []    # stages run the seam
    assert problems("plan.qat=int8", "mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1",
                    "plan.compression=int8") == []      # the data region keeps the projection
    assert problems("plan.qat=fp8", "model.moe_experts=4") == []   # the experts: `grouped`
    with pytest.raises(ValueError, match="batch or summed-out"):
        numerics.int8_matmul("bij,bjk->bik", jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)))
    # the plan names its implementation in the rules; the label names the method
    spec = Spec.from_config(tiny_config("plan.qat=fp8"), 8)
    assert spec.rules.seams["projection"] == "qat_fp8"
    assert "qat-fp8(h16)" in spec.label()
