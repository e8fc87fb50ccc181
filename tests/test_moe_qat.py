"""Quantisation-aware training of a mixture of experts: the expert matmuls run as 8-bit grouped
matmuls (int8 s8 x s8 -> s32; fp8 e4m3 forward, e5m2 gradients, the expert stack's scales in
the delayed-scaling slots), equal one device's QAT on expert, tensor and sequence parallel
layouts, within the 8-bit tolerance of the unquantised model.
(jaxscale/strategies/qat/ragged.py, jaxscale/hooks/projection.py: project_grouped)"""
import jax
import numpy as np
import pytest

from jaxscale.train.setup import build
from tests import test_moe as base
from tests.helpers import MESH_1, tiny_config
from tests.test_quant_training import dot_operands

INT8 = (*base.DROPLESS, "plan.qat=int8")
FP8 = (*base.DROPLESS, "plan.qat=fp8", "plan.fp8_amax_history=3")


def one_device(*overrides):
    return base.loss_and_grads(base.setup_of(*MESH_1, *overrides, devices=jax.devices()[:1]))


@pytest.mark.parametrize("method,layout", [
    ("int8", "dp2 x ep4"), ("int8", "dp2 x ep2 x tp2 megatron-sp"),
    ("int8", "ep2 x sp2 x tp2 ring"), ("fp8", "dp2 x ep4"),
    ("fp8", "dp2 x ep2 x tp2 megatron-sp")])
def test_quantised_experts_match_one_device(method, layout):
    """The per-row, per-channel and per-tensor scales are the whole arrays' (maxima over the
    region's pieces), so every layout computes one device's quantised model; fp8 on a tp
    layout too, its column weights' amaxes taken over their tp shards (with the shards' own the
    gradients were 3.4e-4 of a leaf's largest apart)."""
    ov = INT8 if method == "int8" else FP8
    mesh = base.MESHES[4] if layout == "dp2 x ep4" else base.SPLIT[layout]
    base.assert_close(base.loss_and_grads(base.setup_of(*mesh, *ov)), one_device(*ov))


@pytest.mark.parametrize("method,tol", [("int8", 2e-4), ("fp8", 1e-3)])
def test_quantised_experts_stay_near_the_unquantised_loss(method, tol):
    """QAT moves the experts' outputs (the gradients of the experts change by up to ~1% int8,
    ~15% fp8: 2 and 3 mantissa bits), the loss by less than `tol`."""
    ov = INT8 if method == "int8" else FP8
    (loss, grads), (ref, ref_grads) = one_device(*ov), one_device(*base.DROPLESS)
    assert abs(loss - ref) / ref < tol
    w, r = (np.asarray(g["layers"]["mlp"]["w_gate"]) for g in (grads, ref_grads))
    assert 0 < np.abs(w - r).max()                    # the experts are quantised


def test_expert_matmuls_are_8_bit_dots():
    """int8: the block's seven matmuls per layer (four attention, the experts' three grouped
    ones) are s8 dots; fp8: before XLA:CPU widens them, e4m3 x e4m3 forward, e5m2 x e4m3 (dx)
    and e4m3 x e5m2 (dw, the grouped dot contracting each expert's rows) backward."""
    mesh = ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4")
    int8 = build(tiny_config(*base.TINY, *mesh, *INT8))
    dots = dot_operands(int8.lower_train_step().compile().as_text())
    assert dots[("s8", "s8", "s32")] == 7 * int8.cfg.model.n_layers
    fp8 = build(tiny_config(*base.TINY, *mesh, *FP8))
    pre = dot_operands(fp8.lower_train_step().as_text(dialect="hlo"))
    e4, e5 = "f8e4m3fn", "f8e5m2"
    assert pre[(e4, e4, "f32")] == 7 and pre[(e5, e4, "f32")] == 7
    assert pre[(e4, e5, "f32")] == 7
