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
    bf16_peak = 989e12                               # H200, dense bf16 (the H100's figure)
    assert row["mfu"] == pytest.approx(flops / row["step_time_s"] / (bf16_peak * 8), rel=1e-6)


def test_planner_mfu_is_model_flops_over_the_step_and_the_bf16_peak():
    """By hand, on 8 H100s: the model FLOPs per token are 6 x the matmul parameters (every
    block's q, k, v, o and SwiGLU weights, and the head; not the embedding, not the norms) plus
    the causal attention 6 L H hd s; the planner's MFU is those FLOPs of the whole batch over
    its predicted step time and 8 x the H100's dense bf16 peak, 989 TFLOP/s."""
    cfg = tiny_config("plan.precision=bf16", "mesh.device_kind=h100")
    pred = planner.predict(cfg)
    m, s, tokens = cfg.model, cfg.data.seq_len, cfg.data.batch_size * cfg.data.seq_len
    V, D, L, H, K, hd, F = 320, 128, 2, 8, 4, 16, 384
    assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.hd, m.ffn_dim) == \
        (V, D, L, H, K, hd, F)
    assert pred.spec.n_devices == 8 and (s, tokens) == (32, 256)
    matmul = L * (D * (H + 2 * K) * hd + H * hd * D + 3 * D * F) + D * V
    flops = tokens * (6 * matmul + 6 * L * H * hd * s)
    assert pred.flops.model_per_device * 8 == pytest.approx(flops, rel=1e-12)
    assert pred.time.total > 0
    assert pred.time.mfu == pytest.approx(flops / (pred.time.total * 989e12 * 8), rel=1e-12)
