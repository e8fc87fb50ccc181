"""benchmarks.gpu_step on a CPU: the tiny preset end to end (jax and torch eager, each in its own
process), and the XLA GPU flag preset accepted by this jaxlib's flag parser. The GPU figures
themselves need a GPU; torch.compile is not requested here (minutes on a CPU)."""
import json
import os
import statistics
import subprocess
import sys

import pytest

from jaxscale.benchmarks import gpu_step


def test_tiny_cpu_run_writes_table_json_and_png(tmp_path, capsys):
    rc = gpu_step.main(["--preset", "tiny", "--device", "cpu", "--sides",
                        "jax,jax-xla-flags,jax-unrolled,torch-eager", "--warmup", "1",
                        "--steps", "2", "--timeout", "120", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads((tmp_path / "results.json").read_text())
    res = {r["side"]: r for r in doc["results"]}
    assert set(res) == {"jax", "jax-xla-flags", "jax-unrolled", "torch-eager"}
    # the tiny preset by hand: D 128, 2 layers, 4 heads of 32, 2 kv heads, ffn 384, vocab 320,
    # batch 4 x seq 64. Model FLOPs per token: 6 x the matmul parameters (q, k, v, o, SwiGLU,
    # head) + causal attention 6 L H hd s; MFU over the CPU profile's peak (2.5 GHz x 32 FLOP
    # per cycle and core, one simulated device: the whole host).
    D, L, H, K, hd, F, V, s, tokens = 128, 2, 4, 2, 32, 384, 320, 64, 4 * 64
    flops = tokens * (6 * (L * (D * (H + 2 * K) * hd + H * hd * D + 3 * D * F) + D * V)
                      + 6 * L * H * hd * s)
    assert flops == tokens * 2_703_360
    peak = (os.cpu_count() or 1) * 2.5e9 * 32
    median = {side: statistics.median(res[side]["timed_times_s"])
              for side in ("jax", "jax-unrolled", "torch-eager")}
    for side in ("jax", "jax-unrolled", "torch-eager"):
        r = res[side]
        assert r["status"] == "ok", r
        assert len(r["step_times_s"]) == 3 and r["timed_times_s"] == r["step_times_s"][1:]
        assert r["median_step_s"] == median[side] > 0
        assert r["tokens_per_step"] == tokens
        assert r["tokens_per_s"] == pytest.approx(tokens / median[side], rel=1e-12)
        assert r["mfu"] == pytest.approx(flops / (median[side] * peak), rel=1e-12)
        assert all(loss == loss and loss < 20 for loss in r["losses"])          # finite losses
        assert r["ratio_to"] == "torch-eager"
        # tokens/s over torch eager's: the inverse ratio of the median step times
        assert r["ratio"] == pytest.approx(median["torch-eager"] / median[side], rel=1e-12)
        assert side in out
    assert res["jax"]["scan_layers"] and not res["jax-unrolled"]["scan_layers"]
    assert res["jax"]["attention"] == "auto" and res["torch-eager"]["attention"] == "sdpa:default"
    # the XLA GPU flag side is not run on a CPU, and says so
    assert res["jax-xla-flags"]["status"] == "skipped" and res["jax-xla-flags"]["note"]
    assert doc["config"]["jax_overrides"][0] == "mesh=cpu1"
    assert doc["environment"]["packages"]["jax"] and doc["environment"]["packages"]["torch"]
    assert (tmp_path / "step.png").stat().st_size > 0
    assert "tokens/s" in out and "MFU" in out


def _jax_starts_with(flags: str) -> int:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c",
                           "import jax; jax.numpy.zeros(2).block_until_ready()"],
                          env=env, capture_output=True, timeout=120).returncode


def test_xla_gpu_flag_preset_is_accepted_by_xla():
    # XLA aborts on an unknown flag or value, so the control must fail and the preset pass
    assert _jax_starts_with("--xla_gpu_enable_no_such_flag=true") != 0
    assert _jax_starts_with("--xla_gpu_enable_command_buffer=NO_SUCH_COMMAND") != 0
    assert _jax_starts_with(gpu_step.XLA_GPU_PRESET) == 0


def test_gpu_check_runs_its_stages_on_cpu(tmp_path):
    """The one-call GPU job (`benchmarks/gpu_check.py`), smoke-tested on CPU with tiny shapes."""
    from jaxscale.benchmarks import gpu_check
    assert gpu_check.main(["--allow-cpu", "--tiny", "--only", "inspect,tune", "--out",
                           str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "the model formula" in summary and "device total" in summary
    assert "- tune (rc 0" in summary and "table written to" in summary
    assert (tmp_path / "inspect.log").exists() and (tmp_path / "summary.json").exists()


def test_pipeline_bench_measures_op_costs_and_simulates_every_schedule(tmp_path):
    """The GPU job's pipeline stage on one CPU device: measured T_F, T_B, T_W, and each
    schedule's makespan from them (ZB-V's idle time below 1F1B's whenever W takes time)."""
    import json

    from jaxscale.benchmarks import pipeline_bench
    assert pipeline_bench.main(["--allow-cpu", "--tiny", "--devices", "1", "--p", "2", "--m",
                                "4", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "pipeline.json").read_text())
    c = out["costs"]
    assert out["p"] == 2 and c["layers"] == 4 and min(c["t_f"], c["t_b"], c["t_w"]) > 0
    rows = {r["schedule"]: r for r in out["simulated"]}
    assert set(rows) == set(pipeline_bench.SCHEDULES)
    for r in rows.values():
        assert r["makespan_s"] >= r["ideal_s"] * (1 - 1e-9)
        assert r["bubble"] == pytest.approx(1 - r["ideal_s"] / r["makespan_s"])
    assert rows["zb-v"]["makespan_s"] < rows["1f1b"]["makespan_s"]
