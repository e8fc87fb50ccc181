"""The pipeline composed with the other strategies inside its stages (`jaxscale.strategies.pp`):
context parallelism (ring, Ulysses), Megatron sequence parallelism, collective matmul, 8-bit QAT
(fp8 with delayed scaling, also through ZB-H1's weight pass), host offload of the state and of
the remat policy's activations, fsdp's gradients reduced once per step (`plan.grad_sync=step`:
one reduce-scatter of the accumulated gradient, each stage its own layers), and ZB-V. Each
family against one device over 3 real AdamW updates (`tests/numerics.py`, fp32 1e-5 of each
leaf's largest gradient unless the method says otherwise), its census equal to the plan's
formula row by row, its matmul FLOPs to the planner's, and its compiled temporaries within 10%
of the planner's (one compile per family: `train_temp`). Context parallelism inside a stage is
also read op by op from the compiled step (`tests/stage_hlo.py`): each stage's forward and
backward exchange the K/V blocks (ring) or the heads (Ulysses) over sp, by hand from the
shapes, and never gather the whole sequence."""
import jax
import numpy as np
import pytest

from jaxscale import plan, planner
from jaxscale.analysis import hlo, hlo_flops, inspect
from jaxscale.strategies.pp import program
from tests import numerics, stage_hlo

COMMON = ("model.n_layers=4", "plan.accumulate=2", "data.batch_size=8", "mesh.dp=1")
FAMILIES = {   # name -> (model and plan overrides both runs share, the mesh of the pipeline,
               #          the tolerance, the planner's temporaries' tolerance)
    "pp2 x sp2 x tp2 ring": ((), ("mesh.pp=2", "mesh.sp=2", "mesh.tp=2", "mesh.fsdp=1",
                                  "plan.context=ring"), numerics.FP32, 0.10),
    "pp2 x sp2 x tp2 Ulysses": ((), ("mesh.pp=2", "mesh.sp=2", "mesh.tp=2", "mesh.fsdp=1",
                                     "plan.context=ulysses"), numerics.FP32, 0.10),
    "pp2 x fsdp2 x tp2 Megatron SP": ((), ("mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2",
                                           "plan.sequence_parallel=true"), numerics.FP32, 0.10),
    "pp2 x tp4 collective matmul": (("model.n_kv_heads=4",), (
        "mesh.pp=2", "mesh.tp=4", "mesh.fsdp=1", "plan.sequence_parallel=true",
        "plan.tp_overlap=collective_matmul"), numerics.FP32, 0.10),
    "pp2 x fsdp4 fp8 QAT": (("plan.qat=fp8",), ("mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1"),
                            numerics.QAT_FP8, 0.10),
    "pp2 x fsdp4 fp8 QAT ZB-H1": (("plan.qat=fp8",), ("mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1",
                                                      "plan.schedule=zb-h1"),
                                  numerics.QAT_FP8, 0.10),
    "pp2 x dp2 x tp2 offload": (("plan.offload=optimizer", "plan.remat=offload"), (
        "mesh.pp=2", "mesh.dp=2", "mesh.tp=2", "mesh.fsdp=1"), numerics.FP32, 0.10),
    "pp2 x fsdp2 x tp2 grad_sync=step": (("plan.grad_sync=step",), (
        "mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2"), numerics.FP32, 0.10),
    "pp2 x fsdp2 x tp2 ZB-V": (("plan.accumulate=4", "data.batch_size=16"), (
        "mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2", "plan.schedule=zb-v"), numerics.FP32, 0.10),
}
#: census rows the formula does not model, and why: under fp8 QAT GSPMD gathers fsdp's weights
#: as it chooses (in e4m3 for some, whole for others), with or without the pipeline
UNMODELLED = {"pp2 x fsdp4 fp8 QAT": ("fsdp",), "pp2 x fsdp4 fp8 QAT ZB-H1": ("fsdp",)}
#: the family whose `train` step is also compiled on its own, to check `train_temp` to the byte
CHECKED = "pp2 x sp2 x tp2 Ulysses"
_REFS: dict = {}


def train_temp(got) -> int:
    """The compiled temporaries of the train step as `train` compiles it, read from the step the
    numerics run compiled (with the mean gradients as an output), not from a second compile.

    The two are one program but for those gradients: `train`'s step holds them in temporaries
    from the backward's reduction through the update; the numerics step writes them to output
    buffers instead. So `train`'s temp is this step's temp plus the gradients' bytes per device
    (their shards as this step outputs them). Measured against `train`'s own compile on these
    nine families: equal to the byte on eight; on grad_sync=step 16,640 B (0.2%) above it. One
    family (`CHECKED`) compiles `train`'s step as well and checks the equality every run."""
    grads = jax.tree.leaves(got.compiled.out_info[1]["grads"])
    shards = sum(int(np.prod(g.sharding.shard_shape(g.shape))) * g.dtype.itemsize for g in grads)
    return int(got.compiled.memory_analysis().temp_size_in_bytes) + shards


def _reference(shared):
    if shared not in _REFS:
        _REFS[shared] = numerics.one_device(*COMMON, *shared)
    return _REFS[shared]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_one_device_and_its_formulas(family):
    shared, mesh, tol, memory = FAMILIES[family]
    got = numerics.run((*COMMON, *shared, *mesh))
    worst = numerics.assert_matches(got, _reference(shared), tol)
    print(f"{family}: {worst}")
    cfg = got.setup.cfg
    spec = plan.Spec.from_config(cfg, 8)
    census = inspect.census(got.text, got.setup.placement.mesh, plan.branch_share(spec))
    rows = inspect.theory_vs_census(plan.collectives(spec), census)
    for r in rows:
        if tuple(r["axes"]) not in [UNMODELLED.get(family)]:
            assert r["census_bytes"] == pytest.approx(r["theory_bytes"], rel=0.02), (family, r)
    assert {r["kind"] for r in rows if r["axes"] == ["pp"]} == {"collective-permute",
                                                              "all-reduce"}
    pred = planner.predict(cfg)
    flops = hlo_flops.dot_flops(hlo.Module(got.text, plan.branch_share(spec)))
    assert pred.flops.per_device == pytest.approx(flops, rel=0.01), family
    temp = train_temp(got)                          # the train step as `train` compiles it
    if family == CHECKED:
        assert temp == inspect.report(cfg)["memory"]["temp"], family
    assert pred.memory.xla["temp"] == pytest.approx(temp, rel=memory), family
    if cfg.mesh.sp > 1:
        for key, op in stage_hlo.branches(got.text, got.setup.placement.mesh,
                                          program.program_for(spec)).items():
            want = _context_exchange(cfg, *key)
            assert op.sent("all-to-all", ("sp",)) == want, (key, op.collectives)
            assert op.sent("all-gather", ("sp",)) == (0, 0), (key, op.collectives)
    if "offload" in family:         # the moments in host memory between steps
        host = [x for x in jax.tree.leaves(got.setup.abstract_state().opt_state) if x.ndim]
        assert host and all(x.sharding.memory_kind == "pinned_host" for x in host)


def _context_exchange(cfg, kind, row0, n, first, last) -> tuple[int, int]:
    """(all-to-alls, bytes) over sp of one run of a stage op of n layers on one device, by hand
    from the shapes: b sequences of the micro-batch per device, T / sp of each sequence's
    tokens, H / tp query and KV / tp kv heads of hd. Ring: each layer's forward passes its K/V
    block (2 x b x T/sp x KV/tp x hd floats) to the next of the sp devices, sp - 1 hops; the
    backward the K/V block again and its gradient. Inside the pipeline's switch a permute runs
    as an all-to-all whose result holds a block for each of the sp devices (`axes.permute`).
    Ulysses: q, k, v to head-sharded and the output back, 4 all-to-alls per layer forward of
    their own size, and their 4 transposes backward."""
    m, sp, tp = cfg.model, cfg.mesh.sp, cfg.mesh.tp
    b = cfg.data.batch_size // cfg.plan.accumulate // (cfg.mesh.dp * cfg.mesh.fsdp)
    tokens, hd = b * cfg.data.seq_len // sp, m.dim // m.n_heads
    if cfg.plan.context == "ring":
        block = 2 * tokens * m.n_kv_heads // tp * hd * 4
        hops = n * (sp - 1) * (1 if kind == "F" else 2)
        return hops, hops * sp * block
    qkvo = tokens * (2 * m.n_heads + 2 * m.n_kv_heads) // tp * hd * 4
    return 4 * n, n * qkvo
