"""MFU: one definition (`hardware.mfu`) with the plan's compute dtype, in the loop and the
planner."""
import json

import pytest

from jaxscale import hardware, planner
from jaxscale.analysis.validation import tiny_config
from jaxscale.cli import main
from jaxscale.models.llama import ModelConfig
from jaxscale.strategies import precision
from tests.helpers import SMALL_ARGS


def test_the_h200_run_reads_41_percent_not_608():
    """The first H200 run: 110.3k tokens/s of a 0.57B LLaMA in bf16 (../shared/gpu/README.md)
    reported MFU 6.08 with the fp32 peak; with the plan's compute dtype it is 0.41."""
    model = ModelConfig(vocab_size=320, dim=2048, n_layers=12, n_heads=16, n_kv_heads=8,
                        ffn_dim=5632, max_seq_len=2048)
    plan = tiny_config("plan.precision=bf16").plan
    flops = model.flops_per_token(2048) * 16384
    step_s = 16384 / 110_300
    got = hardware.mfu(flops, step_s, "h200", precision.compute_dtype(plan), 1)
    assert got == pytest.approx(0.41, abs=0.01)
    assert hardware.mfu(flops, step_s, "h200", "float32", 1) > 6     # the old reading


def test_train_metrics_use_the_plans_compute_dtype(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "llama_tiny", "--steps", "2", "--out", str(out), *SMALL_ARGS,
                 "--set", "plan.precision=bf16", "--set", "mesh.device_kind=h200"]) == 0
    row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    cfg = json.loads((out / "config.json").read_text())
    flops = ModelConfig(**{k: v for k, v in cfg["model"].items() if k != "rope_scaling"}) \
        .flops_per_token(cfg["data"]["seq_len"]) \
        * cfg["data"]["batch_size"] * cfg["data"]["seq_len"]
    bf16_peak = hardware.get("h200").peak_bf16
    assert row["mfu"] == pytest.approx(flops / row["step_time_s"] / (bf16_peak * 8), rel=1e-6)


def test_planner_mfu_is_the_same_function():
    pred = planner.predict(tiny_config("plan.precision=bf16", "mesh.device_kind=h100"))
    s = pred.spec
    assert pred.time.mfu == pytest.approx(hardware.mfu(
        pred.flops.model_per_device * s.n_devices, pred.time.total, "h100", "bfloat16",
        s.n_devices))
