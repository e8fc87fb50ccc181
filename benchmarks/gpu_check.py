"""Everything GPU-side in one call, for a session that is lent a GPU (under 9.5 minutes on an
H200: the stages' limits add up to 560 s).

    python -m benchmarks.gpu_check                       # on the GPU machine (no install needed:
                                                         # PYTHONPATH=. works as well)
    python -m benchmarks.gpu_check --allow-cpu --tiny    # CPU smoke test of the same stages

Stages, each a subprocess with its own time limit (a failed or timed-out stage is recorded and
the next one runs):
1. `inspect`: the 0.57B bf16 step of `../shared/gpu/README.md` compiled, not run: per-device
   memory, the census, and the matmul FLOPs read from the HLO by source (cuBLAS, Triton, cuDNN)
   against the model formula (expected 1.01-1.02: cuDNN's backward recomputes QK^T);
2. `offload`: the same with `plan.offload=optimizer+master` (the update streamed through the
   device one layer at a time, `jaxscale.strategies.offload`): device total and temp against
   stage 1, and the goal of issue 12, PASS or FAIL: the device total falls by >= 80% of the
   offloaded bytes (`host_argument`; the planner predicts 100%: `jaxscale plan`);
3. `step`: `benchmarks.gpu_step` (jaxscale vs torch.compile, tokens/s, MFU);
4. `tune`: `experiments/gpu_flash_bench.py --tune` at head_dim 128: the Pallas tile, warp and
   stage sweep, written to `tune/flash_tuning.json` (copy it over
   `jaxscale/kernels/flash_tuning.json` to keep it);
5. `attention`: `experiments/gpu_flash_bench.py` at head_dim 128, seq 8k (Pallas vs cuDNN), with
   the table stage 4 wrote (`JAXSCALE_FLASH_TUNING`);
6. `pipeline`: `benchmarks.pipeline_bench`: a stage's T_F, T_B, T_W measured on the device and
   every schedule's bubble in wall time from them (with several devices, the engine timed per
   schedule beside the unpipelined step).
Writes `summary.md` and `summary.json` (date, device, versions, every stage's result) to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.dim=2048", "model.n_layers=12", "model.n_heads=16", "model.n_kv_heads=8",
         "model.ffn_dim=5632", "model.max_seq_len=2048", "data.seq_len=2048", "data.batch_size=8",
         "plan.precision=bf16", "mesh=h200x1"]
TINY = ["model.n_layers=2", "data.seq_len=64", "data.batch_size=8", "plan.precision=bf16",
        "mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1"]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def stages(args) -> list[tuple[str, list[str], float]]:
    """(name, command, seconds allowed)."""
    py = sys.executable
    over = TINY if args.tiny else MODEL
    out = Path(args.out)
    inspect = [py, "-m", "jaxscale.cli", "inspect", "llama_tiny", *_sets(over), "--json"]
    step = [py, "-m", "benchmarks.gpu_step", "--out", str(out / "step")]
    step += (["--preset", "tiny", "--sides", "jax,torch-eager", "--steps", "2", "--warmup", "1"]
             if args.tiny else ["--sides", "jax,torch-compile", "--warmup", "3", "--steps", "10"])
    attn = [py, str(ROOT / "experiments" / "gpu_flash_bench.py"), "--out", str(out / "attention"),
            "--head-dims", "128", "--seqs", "256" if args.tiny else "8192",
            "--time-budget", "40" if args.tiny else "120"]
    tune = [py, str(ROOT / "experiments" / "gpu_flash_bench.py"), "--tune", "--head-dims", "128",
            "--out", str(out / "tune")]
    pipe = [py, "-m", "benchmarks.pipeline_bench", "--out", str(out / "pipeline")]
    if args.allow_cpu:
        attn.append("--allow-cpu")
        tune += ["--allow-cpu", "--tiny"]
        pipe += ["--allow-cpu", "--tiny"]
    return [("inspect", inspect, 90.0),
            ("offload", inspect[:-1] + ["--set", "plan.offload=optimizer+master", "--json"], 90.0),
            ("step", step, 120.0),
            ("tune", tune, 90.0),
            ("attention", attn, 90.0),
            ("pipeline", pipe, 80.0)]


def run_stage(name: str, cmd: list[str], limit: float, log: Path, **env_extra: str) -> dict:
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        **env_extra)
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit, env=env)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    return {"stage": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
            "stdout": stdout, "log": str(log)}


def _json_from(stdout: str) -> dict | None:
    start = stdout.find("{")
    try:
        return json.loads(stdout[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        return None


def offload_check(base: dict, off: dict) -> dict:
    """Issue 12's goal from two `memory` objects of `jaxscale inspect --json` (without and with
    `plan.offload`): the device total falls by at least 80% of the bytes kept in host memory."""
    mib = 2 ** 20
    host = off["host_argument"]
    saved = base["total"] - off["total"]
    fraction = saved / host if host else 0.0
    return {"host_mib": host / mib, "total_mib": off["total"] / mib, "temp_mib": off["temp"] / mib,
            "base_total_mib": base["total"] / mib, "base_temp_mib": base["temp"] / mib,
            "saved_mib": saved / mib, "fraction": fraction, "pass": bool(host) and fraction >= 0.8}


def summarise(results: dict) -> list[str]:
    lines = []
    rep = _json_from(results.get("inspect", {}).get("stdout", ""))
    if rep:
        f, m = rep["flops"], rep["memory"]
        ratio = f["dot_flops"] / f["model_flops_per_device"]
        lines.append(f"- inspect: matmul FLOPs from HLO {f['dot_flops']:.4g} = {ratio:.4f}x the "
                     f"model formula; by source "
                     + ", ".join(f"{k} {v:.3g}" for k, v in f.get("matmul_flops_by_source",
                                                                  {}).items() if v)
                     + f"; device total {m['total'] / 2**20:,.0f} MiB (temp "
                       f"{m['temp'] / 2**20:,.0f})")
        off = _json_from(results.get("offload", {}).get("stdout", ""))
        if off:
            o = offload_check(m, off["memory"])
            results["offload"]["check"] = o
            lines.append(f"- offload optimizer+master (streamed update): host {o['host_mib']:,.0f} "
                         f"MiB; device total {o['total_mib']:,.0f} MiB (temp "
                         f"{o['temp_mib']:,.0f}) vs {o['base_total_mib']:,.0f} (temp "
                         f"{o['base_temp_mib']:,.0f}) without: falls by {o['saved_mib']:,.0f} MiB "
                         f"= {o['fraction']:.0%} of the offloaded bytes (goal >= 80%): "
                         + ("PASS" if o["pass"] else "FAIL" if o["host_mib"] else
                            "n/a (no host memory reported: XLA:CPU keeps one memory)"))
    for name in ("step", "tune", "attention", "pipeline"):
        r = results.get(name)
        if r:
            tail = [ln for ln in r["stdout"].strip().splitlines() if ln.strip()][-8:]
            lines.append(f"- {name} (rc {r['rc']}, {r['seconds']} s):")
            lines += [f"      {ln}" for ln in tail]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (smoke test)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (with --allow-cpu)")
    ap.add_argument("--only", help="comma list of stages: inspect,offload,step,tune,attention,"
                                   "pipeline")
    args = ap.parse_args(argv)
    import shutil

    from jaxscale.benchmarks.gpu_step import gpu_visible
    if not args.allow_cpu and not gpu_visible():
        ap.error("no NVIDIA GPU found (nvidia-smi); use --allow-cpu --tiny for a CPU smoke test")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.only.split(",")) if args.only else None
    results = {}
    for name, cmd, limit in stages(args):
        if wanted and name not in wanted:
            continue
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        table = out / "tune" / "flash_tuning.json"
        extra = {"JAXSCALE_FLASH_TUNING": str(table)} if name == "attention" and \
            table.exists() else {}
        results[name] = run_stage(name, cmd, limit, out / f"{name}.log", **extra)
        print(f"[{name}] rc {results[name]['rc']} in {results[name]['seconds']} s", flush=True)
    device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip() \
        if shutil.which("nvidia-smi") else platform.processor() or "cpu"
    head = [f"# GPU check, {datetime.datetime.now().isoformat(timespec='minutes')}",
            f"device: {device}; python {platform.python_version()}", ""]
    text = "\n".join(head + summarise(results)) + "\n"
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(
        {"device": device, "results": {k: {kk: vv for kk, vv in v.items() if kk != "stdout"}
                                       for k, v in results.items()}}, indent=2) + "\n")
    print("\n" + text)
    return 0 if all(r["rc"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
