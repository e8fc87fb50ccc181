"""Pipeline stages as layouts (`jaxscale.strategies.pp.stages`) and the pipeline with the
strategies that change what a stage computes: uneven stages (3+1 and 2+3 layers) and mixtures
of experts over ep (dropping and dropless) against one device, local SGD's replicas made of
pipelines against the same replicas without one, checkpoints restored under another stage
layout, schedule and pp, and the default layout `auto` on published shapes. Each family also
runs what its mechanism says, read from the compiled step op by op (`tests/stage_hlo.py`) and
set beside values derived by hand from the shapes: a shorter stage computes its real layers
only, ZB-H1's W the weight gradients B left out, and the experts inside a stage live E / ep to
a device and exchange their tokens over ep."""
import math

import jax
import numpy as np
import pytest

from jaxscale import plan
from jaxscale.data import Batches, load_corpus
from jaxscale.strategies.pp import program, stages
from jaxscale.strategies.pp.schedules import loop_placement, v_placement
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train import disk
from jaxscale.train.setup import build
from tests import numerics, stage_hlo
from tests.helpers import tiny_config

MOE = ("model.n_layers=4", "plan.accumulate=2", "data.batch_size=16", "model.moe_experts=4",
       "mesh.fsdp=1")
CASES = {   # name -> (shared overrides, the pipeline's mesh and layout)
    "MoE pp2 x ep2 x tp2": (MOE, ("mesh.dp=1", "mesh.pp=2", "mesh.ep=2", "mesh.tp=2")),
    "MoE pp2 x dp2 x ep2": (MOE, ("mesh.dp=2", "mesh.pp=2", "mesh.ep=2", "mesh.tp=1")),
    "MoE pp2 x dp2 x ep2 dropless": ((*MOE, "model.moe_dropless=true"),
                                     ("mesh.dp=2", "mesh.pp=2", "mesh.ep=2", "mesh.tp=1")),
    "uneven 3+1": (("model.n_layers=4", "plan.accumulate=2", "data.batch_size=8"),
                   ("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1",
                    "plan.stage_layers=3,1")),
    "uneven 2+3 ZB-H1": (("model.n_layers=5", "plan.accumulate=2", "data.batch_size=8"),
                         ("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1",
                          "plan.stage_layers=2,3", "plan.schedule=zb-h1")),
}


@pytest.mark.parametrize("case", CASES)
def test_stage_family_matches_one_device(case):
    shared, mesh = CASES[case]
    got = numerics.run((*shared, *mesh))
    ref = numerics.one_device(*shared)
    tol = numerics.MOE if case.startswith("MoE") else numerics.FP32
    print(case, numerics.assert_matches(got, ref, tol))
    for key in ref.metrics[0]:        # the router losses and the dropped share, summed over the
        if key.startswith("moe_"):    # stages and micro-batches as one device sums its layers
            assert got.metrics[0][key] == pytest.approx(ref.metrics[0][key], rel=1e-5), key
    order = got.setup.layout.layer_order
    if case.startswith("uneven"):     # the shorter stage's block ends in padding rows
        counts = stages.counts(got.setup.placement.spec)
        assert counts == tuple(int(c) for c in mesh[-2 if "ZB" in case else -1]
                               .split("=")[1].split(","))
        rows = max(counts)
        assert len(order) == 2 * rows and order.count(-1) == 2 * rows - sum(counts)
        assert sorted(r for r in order if r >= 0) == list(range(sum(counts)))
        padding = [i for i, r in enumerate(order) if r < 0]
        params = jax.device_get(got.setup.init_state().params)["layers"]["attn"]["wq"]
        assert not np.any(params[padding]) and np.all(np.any(params[[i for i in range(
            len(order)) if i not in padding]], axis=(1, 2, 3)))
    ops = stage_hlo.branches(got.text, got.setup.placement.mesh,
                             program.program_for(got.setup.placement.spec))
    assert {key[0] for key in ops} == ({"F", "B", "W"} if "ZB" in case else {"F", "B"})
    for key, op in ops.items():
        if case.startswith("uneven"):
            want = _stage_flops(got.setup.cfg, *key)
            assert op.flops == want, f"{key}: {op.flops:.0f} matmul FLOPs, {want} by hand"
        else:
            _assert_experts_inside(got.setup.cfg, key, op)


def _stage_flops(cfg, kind, row0, rows, first, last) -> float:
    """One run of a stage op's matmul FLOPs on one device, by hand from the shapes (pp x fsdp:
    each device computes its rows of the micro-batch, the weights gathered whole). Per layer:
    the weight matmuls, 2 x tokens x (q, k, v, o, gate, up, down weights), forward; their
    input gradients as many in B, their weight gradients as many in W (in B when the backward
    is not split); the attention's QK^T and PV over whole [T, T] squares, 2 matmuls forward and
    4 backward. The last stage's F also runs the head forward and backward (3 matmuls of tokens
    x dim x vocab), the first stage's B the embedding's gradient (a [vocab, tokens] x [tokens,
    dim] matmul). Only the stage's real layers count, as `plan.stage_layers` gives them (not the
    `rows` the engine's branch names): a shorter stage's block is padded to the longest's, and
    its padding rows are not computed."""
    m, T = cfg.model, cfg.data.seq_len
    counts = [int(c) for c in cfg.plan.stage_layers.split(",")]     # two stages: first, last
    assert len(counts) == 2 and first != last
    n = counts[0] if first else counts[1]
    seqs = cfg.data.batch_size // cfg.plan.accumulate // (cfg.mesh.dp * cfg.mesh.fsdp)
    hd = m.dim // m.n_heads
    weights = m.dim * (m.n_heads + 2 * m.n_kv_heads) * hd + m.n_heads * hd * m.dim \
        + 3 * m.dim * m.ffn_dim
    w = 2 * seqs * T * weights
    attn = 2 * 2 * seqs * m.n_heads * T * T * hd
    vocab = 2 * seqs * T * m.dim * m.vocab_size
    split = cfg.plan.schedule == "zb-h1"
    if kind == "F":
        return n * (w + attn) + (3 * vocab if last else 0)
    if kind == "B":
        return n * (w + 2 * attn + (0 if split else w)) + (vocab if first else 0)
    return n * w


def _assert_experts_inside(cfg, key, op):
    """Inside a stage the experts live E / ep to a device and the tokens travel to them over ep:
    one run of F or B on a stage of n MoE layers sends the all-to-alls derived here by hand, and
    its expert weight gradients are [E / ep, dim, ffn / tp] (and [E / ep, ffn / tp, dim]).

    Capacity mode: each device's [E, b, C, dim] slot buffer (b sequences per device, C =
    ceil(1.25 x T x top-k / E) slots per expert), sent out and back: 2 per layer in F and 2 in
    B. Dropless: S = ceil(2 x b T k / ep) rows per peer (`plan.moe_buffer` 2, at most b T k),
    an [ep, S, dim] block out and back, after the [ep, E / ep] int32 counts in F: 3 per layer
    in F, 2 in B."""
    kind, m, mesh, T = key[0], cfg.model, cfg.mesh, cfg.data.seq_len
    n = m.n_layers // mesh.pp                       # even stages: each its share of the layers
    E, k, ep, D, ffn = m.moe_experts, m.moe_top_k, mesh.ep, m.dim, m.ffn_dim // mesh.tp
    b = cfg.data.batch_size // cfg.plan.accumulate // (mesh.dp * mesh.fsdp * ep)
    if m.moe_dropless:
        S = min(b * T * k, math.ceil(2.0 * b * T * k / ep))
        block = ep * S * D * 4
        want = (3 * n, n * (E * 4 + 2 * block)) if kind == "F" else (2 * n, 2 * n * block)
    else:
        C = math.ceil(1.25 * T * k / E)
        want = (2 * n, 2 * n * E * b * C * D * 4)
    assert op.sent("all-to-all", ("ep",)) == want, (key, op.collectives)
    if kind == "B":
        grads = {d[0] for d in op.dots if len(d[0]) == 3 and d[0][1:] in ((D, ffn), (ffn, D))}
        assert grads == {(E // ep, D, ffn), (E // ep, ffn, D)}, (key, grads)


def test_local_sgd_replicas_can_be_pipelines():
    """DiLoCo over dp2 whose replicas are pp2 x tp2 pipelines, 4 updates (2 averages), against
    the same replicas as fsdp2 x tp2 groups (one device has no replicas to average)."""
    d = ("plan.local_sgd=diloco", "plan.local_steps=2", "model.n_layers=4",
         "plan.accumulate=2", "data.batch_size=8", "mesh.dp=2", "mesh.tp=2")
    flat = numerics.run((*d, "mesh.fsdp=2"), steps=4)
    piped = numerics.run((*d, "mesh.pp=2", "mesh.fsdp=1"), steps=4)
    numerics.assert_matches(piped, flat, numerics.Tolerance(
        None, 1e-5, 2e-2, 1e-3, "fp32 in another order; local SGD's step shows no gradient"))


# ----------------------------------------------------------------------------- checkpoints
def _next_loss(setup, state, step: int) -> float:
    """The loss the next step would report (its forward, before the update): the eval step's,
    which compiles the plan's forward only."""
    cfg = setup.cfg
    b = Batches(load_corpus(cfg.data).train, cfg.data.batch_size, cfg.data.seq_len, seed=0)
    total, tokens = setup.eval_step(state.params, b.device_batch(step, setup.batch_shardings()))
    return float(total) / float(tokens)


def _weights(setup, state) -> list[np.ndarray]:
    """The parameters in the model's layer order at its true vocabulary, on the host."""
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(disk.to_disk(
        state.params, setup.cfg.model.vocab_size, setup.layout.layer_order)))]


def _moved(a, b, lr: float) -> float:
    """The mean |a - b| over every weight, in learning rates."""
    return float(np.concatenate([np.abs(x - y).ravel() for x, y in zip(a, b)]).mean() / lr)


def _saved(setup, tmp_path):
    """The state after one step under `setup`, saved as `train` saves it: (the next step's loss,
    the saved weights). The step is a real AdamW update (warm-up 0): the weights moved from
    their initial values by `numerics.MOVED["adamw"]` learning rates on average at least, so a
    restore that loaded nothing (the initial weights) cannot pass for one that loaded them."""
    state = setup.init_state()
    initial = _weights(setup, state)
    b = Batches(load_corpus(setup.cfg.data).train, setup.cfg.data.batch_size,
                setup.cfg.data.seq_len, seed=0)
    state, _ = setup.train_step(state, b.device_batch(0, setup.batch_shardings()))
    trained = _weights(setup, state)
    assert _moved(trained, initial, setup.cfg.optim.lr) >= numerics.MOVED["adamw"]
    keep = jax.tree.map(lambda a: a.copy(), state)
    kept = disk.to_disk(keep, setup.cfg.model.vocab_size, setup.layout.layer_order)
    ck = ckpt_lib.Checkpointer(tmp_path, setup.cfg.ckpt)
    ck.save(1, kept, ckpt_meta.make_meta(setup.cfg, kept, 1))
    ck.wait()
    ck.close()
    return _next_loss(setup, state, 1), trained


def _restored(overrides, tmp_path):
    """(the next step's loss, the restored weights, the same plan's initial weights)."""
    cfg = tiny_config(*overrides)
    setup = build(cfg, donate=False)
    _, state, meta, _ = ckpt_lib.restore_latest(tmp_path, cfg.ckpt, cfg, setup.abstract_state(),
                                                setup.layout.layer_order)
    assert meta["step"] == 1
    return (_next_loss(setup, state, 1), _weights(setup, state),
            _weights(setup, setup.init_state()))


@pytest.mark.parametrize("source,targets", [
    (("mesh.pp=2", "mesh.sp=2", "mesh.tp=2", "mesh.fsdp=1"),
     [("mesh.pp=1", "mesh.sp=2", "mesh.tp=2", "mesh.fsdp=2"),
      ("mesh.pp=4", "mesh.sp=2", "mesh.tp=1", "mesh.fsdp=1", "plan.accumulate=4")]),
    (("mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1", "plan.stage_layers=3,1"),
     [("mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1"),
      ("mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2", "plan.schedule=zb-v", "plan.accumulate=4")]),
])
def test_a_checkpoint_restores_under_another_layout(source, targets, tmp_path):
    """Written under one layout (pp2 x sp2; uneven 3+1 stages) after a real update, restored at
    pp1 and pp4 (an even layout and ZB-V's V): the restored weights are the saved ones bit for
    bit (in the model's order), as far from the target's own initial weights as the update moved
    them, and the next step's loss is the same (fp32 in another order)."""
    common = ("model.n_layers=4", "data.batch_size=8", "mesh.dp=1", "plan.accumulate=2")
    src = build(tiny_config(*common, *source), donate=False)
    want, trained = _saved(src, tmp_path)
    for target in targets:
        loss, restored, initial = _restored((*common, *target), tmp_path)
        assert all(np.array_equal(a, b) for a, b in zip(restored, trained)), target
        assert _moved(restored, initial, src.cfg.optim.lr) >= numerics.MOVED["adamw"], target
        assert loss == pytest.approx(want, rel=1e-5), target


# ----------------------------------------------------------------------------- layouts
def test_auto_balances_the_embedding_and_the_head():
    """Llama 3 405B's 126 layers on 16 stages: the head costs 0.64 of a layer, so the first and
    last stages take 7 and the others 8 (the published layout); it is a plan `train` accepts at
    TP8 x PP16 x DP8."""
    from jaxscale import models
    from jaxscale.config import Config, DataConfig, apply_overrides
    from jaxscale.mesh import MeshConfig
    cfg = Config(model=models.get("llama3-405b"), data=DataConfig(seq_len=8192, batch_size=128),
                 mesh=MeshConfig(dp=8, pp=16, fsdp=1, tp=8, device_kind="h100"))
    cfg = apply_overrides(cfg, ["plan.precision=bf16", "plan.accumulate=16"])
    spec = plan.validate(cfg, 1024)
    assert stages.counts(spec) == (7,) + (8,) * 14 + (7,)
    assert stages.device_layers(spec) == [7] + [8] * 14 + [7] and spec.stored_layers == 8
    assert plan.unavailable(spec) == []
    # equal costs split evenly, any remainder on the later stages; one device each at least
    assert stages.balanced(8, loop_placement(2), 0.0, 0.0) == (4, 4)
    assert stages.balanced(7, loop_placement(2), 0.0, 0.0) == (3, 4)
    assert stages.balanced(3, loop_placement(2), 0.0, 5.0) == (2, 1)
    # the V placement puts the first and the last stage on device 0: balanced per device
    assert stages.balanced(9, v_placement(2), 0.0, 1.0) == (2, 2, 3, 2)
    assert sum(stages.balanced(126, v_placement(8), 0.0, 0.64)) == 126


def test_stored_order_pads_each_block():
    spec = plan.Spec.from_config(tiny_config("model.n_layers=5", "mesh.dp=1", "mesh.pp=2",
                                             "mesh.fsdp=4", "mesh.tp=1",
                                             "plan.stage_layers=2,3"))
    assert stages.layer_order(spec) == [0, 1, -1, 2, 3, 4]
    tree = {"layers": {"w": np.arange(5.0)}}
    moved = stages.reorder(tree, None, stages.layer_order(spec))
    assert list(moved["layers"]["w"]) == [0, 1, 0, 2, 3, 4]
    back = stages.reorder(moved, stages.layer_order(spec), None)
    assert list(back["layers"]["w"]) == list(range(5))
    zbv = spec.with_(schedule="zb-v", stage_layers="1,1,1,2", accumulate=4)
    # device 0 holds stages 0 and 3, device 1 stages 1 and 2
    assert stages.layer_order(zbv) == [0, -1, 3, 4, 1, -1, 2, -1]


@pytest.mark.parametrize("schedule", [("plan.schedule=1f1b",),
                                      ("plan.schedule=interleaved", "plan.virtual_stages=2")])
def test_a_shorter_stages_copies_are_in_the_planners_memory(schedule):
    """5 layers on dp4 x pp2 (remat=full): 1F1B's stages of 3 and 2 layers, or interleaved
    chunks of 2, 1, 1, 1 (each device's stack 2 rows a chunk). A 2-layer stage's F and B each
    slice its 2 rows of the stacked weights (a copy: the shorter stage's, or a chunk's of its
    device's stack), and its 2 layers' residuals (the layer inputs of one micro-batch) live
    apart from the padded slot they are written into. By hand: a layer holds 196,864 fp32
    weights (wq and wo 128 x 128, wk and wv 128 x 64, three 128 x 384, two norms), a
    micro-batch is 2 sequences of 32 tokens x 128. The planner's temp is then within 3% of the
    compiler's (0.71 and 0.75 without the term)."""
    from jaxscale import planner
    from jaxscale.analysis import inspect
    cfg = tiny_config("mesh.dp=4", "mesh.pp=2", "mesh.fsdp=1", "mesh.tp=1", "model.n_layers=5",
                      *schedule, "plan.accumulate=2", "data.batch_size=16",
                      "plan.remat=full", "plan.check_memory=false")
    pred = planner.predict(cfg)
    (term,) = [t for t in pred.memory.terms if "sliced weights" in t.what]
    assert term.bytes == 2 * (2 * 196_864 * 4 + 2 * 32 * 128 * 4)
    temp = inspect.memory(build(cfg).lower_train_step().compile())["temp"]
    assert pred.memory.xla["temp"] / temp == pytest.approx(1.0, abs=0.03)
