"""Census equal to the formula, row by row, on an odd model shape (dim 96, 6 query heads over 2
kv heads, ffn 224, vocab 509, seq 64) where two mechanisms once moved more than their formulas:

- a capacity-mode mixture of experts inside pipeline stages whose capacity C equals the
  sequence (capacity factor x top-k >= E): the slot buffer [E, rows, C, ...] has the shape of a
  residual of the micro-batch's tokens ([rows, seq] pair), and its residual slots were laid
  out by the pair, rows over the batch's axes (ep among them) where the stage has the experts
  over ep: every write and read of a slot was an all-to-all (8.9x the formula's over ep, an
  fsdp x ep all-gather beside them on pp2 x fsdp2 x ep2); also the dropless exchange's dropped
  count, summed over ep inside the data region (not over dp and ep);
- full remat with FSDP under tensor parallelism: the column groups' weights (q, k, v; gate, up)
  were gathered at the entry of the group's region, once by the replayed region and once more
  by its transpose (1.21x the formula's fsdp gathers on pp2 x fsdp2 x tp2, 1.30x on
  dp2 x fsdp2 x tp2); gathered before the region, the replay and the backward share one copy.

- ZeRO-3 under a pipeline: the stages' sum of the embedding's, final norm's and head's
  gradients moves their ZeRO-3 shards (dp x fsdp), where the formula counted fsdp's (2x);
- a mixture's statistics under local SGD: a replica's step sums them over its own axes, dp's
  sum is the metrics' (the formula had put dp in their all-reduce's group);
- ZeRO-3 with a strategy's own mean over dp (int8 compression): the data region, manual over
  dp, takes the parameters gathered over dp once at its entry (re-laid from ZeRO-3's (dp, fsdp)
  nesting into fsdp's order by collective-permutes) and gathers over fsdp per use, where the
  formula gathered over (dp, fsdp) per use; a mixture's balance statistics are averaged over
  dp inside it, per layer (the formula had none);
- a mixture under a remat policy that saves its dots: the MoE layer still replays (its dispatch
  and batched expert matmuls carry no saved tag), gathering its experts and router over fsdp
  and the sequence's expert ids over sp again (the formula replayed it under full remat only,
  and kept the gathered experts for the backward);
- a mixture's balance statistics under local SGD (its average compressed: the statistics
  alone all-reduced over dp) and full remat: the replayed layer reduces
  its expert shares again (the mean probabilities' cotangent reads them), not both statistics
  (generated seed 1211: the formula 1.23x the compiled over dp);
- ZeRO-3 x ep with dp splitting a layer's weights within the layer (5 layers over dp4: on the
  embed axis): each layer's non-expert gradient is reduce-scattered over dp and its shard
  all-reduced over ep, where the formula reduced it over (dp, ep) as one group (right where dp
  splits the layer axis, each layer's gradient whole in the scan).

- a pipeline's residual slots on an odd kv-head count (3 over pp2 x dp2 x fsdp2): the
  attention's scores [layers, rows, kv heads, group, T, T] were laid out by the first [rows, seq]
  pair of sizes among their dimensions, the query group (2 = the rows) and T, so the group went
  over fsdp and the rows over dp alone: all-to-alls over fsdp at every write and read (24 a
  step on seed 1131's shape; the formula has none) and fsdp's gathers 0.97 of the formula.
  The rows are now the dimension that doubles with the micro-batch.
- tensor parallelism's column groups with many query heads per device (dim 160, 20 heads of 8
  over tp2, one sequence a device on dp2 x fsdp2 x tp2): left free inside the group's region,
  the input's gradient was computed with the sequences gathered over fsdp and the embedding
  split there like the weight, then all-to-all'd back to the batch split (generated seed 1218:
  fsdp's gathers 0.88 of the formula, an all-to-all over fsdp it lacks). The region's input is
  pinned to the batch layout, which its transpose keeps for the gradient.

Each plan compiles once: the file takes about 115 s on 2 cores."""
import functools
import math

import pytest
from jax.sharding import PartitionSpec as P

from jaxscale import plan
from jaxscale.analysis import inspect
from jaxscale.strategies.pp import engine, program
from jaxscale.train.setup import build
from tests import numerics, stage_hlo
from tests.helpers import tiny_config

SHAPE = ("model.dim=96", "model.n_heads=6", "model.n_kv_heads=2", "model.ffn_dim=224",
         "model.n_layers=5", "model.vocab_size=509", "data.seq_len=64")
#: pp2 x dp2 x ep2, 4 experts, top-2, 2 micro-batches of 4 sequences: one per device
EXPERTS = ("mesh.pp=2", "mesh.ep=2", "model.moe_experts=4", "mesh.tp=1", "plan.accumulate=2",
           "data.batch_size=8")
PLANS = {
    "pp2 x dp2 x ep2, C = T": (*EXPERTS, "mesh.dp=2", "mesh.fsdp=1", "model.capacity_factor=2.0"),
    "pp2 x fsdp2 x ep2, C = T": (*EXPERTS, "mesh.dp=1", "mesh.fsdp=2",
                                 "model.capacity_factor=2.0"),
    "pp2 x dp2 x ep2 dropless": (*EXPERTS, "mesh.dp=2", "mesh.fsdp=1", "model.moe_dropless=true"),
    "pp2 x fsdp2 x tp2 remat=full": ("mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2", "mesh.dp=1",
                                     "plan.remat=full", "plan.accumulate=2", "model.n_layers=4"),
    "dp2 x fsdp2 x tp2 remat=full": ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "plan.remat=full"),
    "dp2 x fsdp2 x tp2 save_dots bf16": ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2",
                                         "plan.remat=save_dots", "plan.precision=bf16",
                                         "plan.accumulate=2"),
    "pp2 x dp2 x fsdp2, query groups of 2": ("mesh.pp=2", "mesh.dp=2", "mesh.fsdp=2",
                                              "mesh.tp=1", "model.n_kv_heads=3",
                                              "model.n_layers=4", "plan.accumulate=2",
                                              "data.batch_size=8"),
    "pp2 x dp2 x fsdp2 ZeRO-3": ("mesh.pp=2", "mesh.dp=2", "mesh.fsdp=2", "mesh.tp=1",
                                 "plan.zero=3", "plan.accumulate=2", "data.batch_size=8"),
    "dp2 x fsdp2 x sp2 DiLoCo MoE ring": ("mesh.dp=2", "mesh.fsdp=2", "mesh.sp=2", "mesh.tp=1",
                                          "plan.context=ring", "plan.local_sgd=diloco",
                                          "plan.local_steps=4", "model.moe_experts=4",
                                          "data.batch_size=8"),
    "dp4 x fsdp2 ZeRO-3 int8 MoE": ("mesh.dp=4", "mesh.fsdp=2", "mesh.tp=1", "plan.zero=3",
                                    "plan.compression=int8", "model.moe_experts=4",
                                    "data.batch_size=8"),
    "dp2 x fsdp2 x sp2 MoE Ulysses save_dots": ("mesh.dp=2", "mesh.fsdp=2", "mesh.sp=2",
                                                 "mesh.tp=1", "plan.context=ulysses",
                                                 "plan.remat=save_dots", "model.moe_experts=4",
                                                 "data.batch_size=8"),
    "dp2 x fsdp2 x ep2 DiLoCo int8 MoE remat=full": ("mesh.dp=2", "mesh.fsdp=2", "mesh.ep=2",
                                                      "mesh.tp=1", "plan.local_sgd=diloco",
                                                      "plan.local_steps=4", "plan.remat=full",
                                                      "plan.compression=int8",
                                                      "model.moe_experts=4", "data.batch_size=8"),
    "dp2 x fsdp2 x tp2, 10 query heads a device": ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2",
                                                   "model.dim=160", "model.n_heads=20",
                                                   "model.n_layers=2", "data.seq_len=32",
                                                   "data.batch_size=4"),
    "dp4 x ep2 ZeRO-3 MoE": ("mesh.dp=4", "mesh.ep=2", "mesh.fsdp=1", "mesh.tp=1", "plan.zero=3",
                             "model.moe_experts=4", "data.batch_size=8"),
}


@functools.lru_cache(maxsize=None)
def _compiled(name):
    setup = build(tiny_config(*SHAPE, *PLANS[name]))
    spec = setup.placement.spec
    text = setup.lower_train_step().compile().as_text()
    census = inspect.census(text, setup.placement.mesh, plan.branch_share(spec))
    return setup, text, inspect.theory_vs_census(plan.collectives(spec), census)


@pytest.mark.parametrize("name", PLANS)
def test_census_is_the_formula_row_by_row(name):
    """Every census row has a formula row within 2% (the scalars XLA sums beside the gradients:
    the loss, the token count, a mixture's statistics), and no formula row is missing."""
    _, _, rows = _compiled(name)
    for r in rows:
        if not r["theory_bytes"] and not r["census_bytes"]:
            continue        # scalar partial sums in tuples (a norm's over ZeRO-3's shards): 0 B
        assert r["theory_bytes"] > 0 and r["census_bytes"] > 0, (name, r)
        assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=0.02), (name, r)


@pytest.mark.parametrize("name", [n for n in PLANS if "C = T" in n])
def test_expert_slots_move_the_slot_buffer_alone(name):
    """The all-to-alls over ep by hand: per MoE layer and micro-batch 4 of each device's slot
    buffer [E, b, C, D] fp32 (b = 1 sequence, C = min(T, ceil(2.0 x T x 2 / 4)) = T), the layers
    averaged over the 2 devices of pp (5 layers: 2.5 each); nothing else over ep but the
    gradients' and statistics' all-reduces (no all-gather)."""
    setup, _, rows = _compiled(name)
    cfg = setup.cfg
    m, T = cfg.model, cfg.data.seq_len
    C = min(T, math.ceil(m.capacity_factor * T * m.moe_top_k / m.moe_experts))
    assert C == T
    buffer = m.moe_experts * 1 * C * m.dim * 4
    a2a = [r for r in rows if r["kind"] == "all-to-all"]
    assert [r["axes"] for r in a2a] == [["ep"]]
    assert a2a[0]["census_bytes"] == 4 * m.n_layers / 2 * cfg.plan.accumulate * buffer
    assert {r["kind"] for r in rows if "ep" in r["axes"]} == {"all-to-all", "all-reduce"}


def test_a_slot_buffer_is_told_from_a_token_residual_of_its_shape():
    """The residual slots' layout (`engine._token_layout`) on pp2 x dp2 x ep2 inside the data
    region (dp manual: the batch over ep): a stacked slot buffer [layers, E, rows, C, F] has its
    experts over ep and its rows over nothing else, even where C is the sequence; a stacked
    residual [layers, rows, T, D] has its rows over ep, also when the stage has E layers; a
    residual without the micro-batch's rows is left to GSPMD."""
    placement = plan.place(tiny_config(*SHAPE, *PLANS["pp2 x dp2 x ep2, C = T"]))
    rules = placement.rules.without(("dp", "pp"))
    layout = engine._token_layout(rules, (4, 64))
    free = P.UNCONSTRAINED
    assert layout((3, 4, 2, 64, 224), 2) == [free, "ep", None, free, free]
    assert layout((4, 2, 64, 96), 1) == [free, "ep", free, free]
    assert layout((3, 2, 2, 3, 64, 64), None) is None
    assert engine._token_layout(rules, None)((3, 4, 2, 64, 224), 2) == \
        [free, free, "ep", free, free]


def test_full_remat_gathers_each_weight_once_per_backward():
    """pp2 x fsdp2 x tp2 under full remat: one B op of a 2-layer stage gathers over fsdp each of
    a layer's 7 matmul weights once (their tp shards: (D (H + 2 KV) hd + H hd D + 3 D F) / tp
    fp32), shared by the replayed forward and the backward, and the 2 RMSNorm scales (D fp32)
    twice: 11 gathers a layer."""
    setup, text, _ = _compiled("pp2 x fsdp2 x tp2 remat=full")
    m, tp = setup.cfg.model, setup.cfg.mesh.tp
    hd = m.dim // m.n_heads
    weights = (m.dim * (m.n_heads + 2 * m.n_kv_heads) * hd + m.n_heads * hd * m.dim
               + 3 * m.dim * m.ffn_dim) // tp * 4
    norms = 2 * 2 * m.dim * 4
    ops = stage_hlo.branches(text, setup.placement.mesh, program.program_for(setup.placement.spec))
    backward = [op for key, op in ops.items() if key[0] == "B"]
    assert len(backward) == 2
    for op in backward:
        assert op.sent("all-gather", ("fsdp",)) == (2 * 11, 2 * (weights + norms))


def test_full_remat_with_weights_gathered_before_the_region_matches_one_device():
    """The same pp2 x fsdp2 x tp2 full-remat plan trains as one device does (3 AdamW updates,
    fp32 tolerance): the gathered weights' gradient reaches each weight's shard whole."""
    shared = tuple(o for o in PLANS["pp2 x fsdp2 x tp2 remat=full"] if not o.startswith("mesh."))
    mesh = tuple(o for o in PLANS["pp2 x fsdp2 x tp2 remat=full"] if o.startswith("mesh."))
    got = numerics.run((*SHAPE, *shared, *mesh))
    numerics.assert_matches(got, numerics.one_device(*SHAPE, *shared), numerics.FP32)



@pytest.mark.parametrize("shape", ["llama_tiny", "6 heads, 96 wide"])
def test_full_remat_may_gather_the_row_weight_again_in_the_replay(shape):
    """dp2 x fsdp2 x tp2 under full remat, no pipeline: tensor parallelism's row region gathers
    wo (its tp shard) at its entry, and the replay and the backward are two regions. XLA gathers
    it a third time per layer on `llama_tiny` (8 heads, 128 wide: [4, 16, 128] fp32) and shares
    one gather on the 6-head, 96-wide shape (2 a layer); the formula's optional row
    (`fsdp.regathered`, beside the LM head's optional backward gather) is counted where it was
    emitted, and the census equals the formula either way."""
    from jaxscale.analysis import hlo
    if shape == "llama_tiny":
        setup = build(tiny_config(*PLANS["dp2 x fsdp2 x tp2 remat=full"],
                                  "plan.check_memory=false"))
        text = setup.lower_train_step().compile().as_text()
        rows = inspect.theory_vs_census(plan.collectives(setup.placement.spec),
                                        inspect.census(text, setup.placement.mesh))
    else:                           # the row-by-row test's compiled step, shared
        setup, text, rows = _compiled("dp2 x fsdp2 x tp2 remat=full")
    m = setup.cfg.model
    wo = (m.n_heads // 2, m.dim // m.n_heads, m.dim)
    mod = hlo.Module(text)
    runs = sum(mod.runs.get(i.computation, 0) for i in mod.instrs
               if i.opcode.startswith("all-gather") and tuple(hlo.shapes(i.type_str)[0][1]) == wo)
    assert runs == (3 if shape == "llama_tiny" else 2) * m.n_layers
    (row,) = [r for r in rows if r["kind"] == "all-gather" and r["axes"] == ["fsdp"]]
    assert row["census_bytes"] == pytest.approx(row["theory_bytes"], rel=1e-4), row
