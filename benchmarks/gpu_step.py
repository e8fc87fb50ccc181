"""python -m benchmarks.gpu_step [--preset h200-0.57b|tiny] [--steps N] [--warmup N]
    [--sides jax,jax-xla-flags,torch-eager,torch-compile] [--out DIR]

One training step, one GPU: jaxscale against PyTorch eager and `torch.compile` on the same LLaMA,
batch, optimizer and attention, plus jaxscale again with an XLA GPU flag preset. Absolute numbers
are quoted only from a GPU run; on a CPU this script only checks that every side works (the
`tiny` preset, seconds), its times say nothing about GPUs.

Sides (each in its own subprocess, `python -m benchmarks.gpu_step --worker SIDE --spec FILE`, so no
side's allocator, compile cache, threads or XLA flags reach another; the parent reads one
`GPU_STEP_RESULT {json}` line from each child's stdout, the child's stderr goes to
`<out>/<side>.log`):
  jax            `jaxscale.train.setup.build(cfg)`: the jitted train step `jaxscale train` runs,
                 from `load_experiment("llama_tiny")` plus the preset's overrides (mesh=h200x1 on a
                 GPU, mesh=cpu1 on a CPU), `plan.precision=bf16` (bf16 compute, fp32 master
                 weights and AdamW), attention `--jax-attention` (default `auto`: cuDNN on a GPU).
  jax-xla-flags  the same with XLA_FLAGS += `--xla-flags` (default `XLA_GPU_PRESET`), set in the
                 child before jax is imported. GPU only: on a CPU the side is skipped with a note.
  jax-unrolled   the `jax` side with `model.scan_layers=false`: the layers as straight-line code
                 instead of one `lax.scan` body (no stacked residuals to copy, longer compile);
                 its first step (compile included) is reported beside the scan's.
  torch-eager    `benchmarks.torch_llama.TorchLlama` of the same shape (fp32 parameters = master
                 weights), bf16 autocast, SDPA attention (`--sdpa`, default: PyTorch's own
                 dispatch, FlashAttention-2 for bf16 causal GQA on an H100/H200), loss = token
                 mean cross-entropy, `clip_grad_norm_(1.0)`, `torch.optim.AdamW` (fused=True on
                 CUDA) with jaxscale's betas, eps, weight decay (none on the norm scales) and
                 warmup + cosine schedule (`torch_llama.warmup_cosine_lr`).
  torch-compile  the same with `torch.compile(model)` (the optimizer step stays eager).
Both frameworks train on one fixed batch of random tokens (numpy seed `--seed`, the same array on
both sides), inputs = tokens[:, :-1], targets = tokens[:, 1:]. Weights are random (normal, std
0.02 on the PyTorch side, jaxscale's init on the JAX side): the loss is printed as a sanity check
only.

Timing: `--warmup` untimed steps (compilation included), then `--steps` timed steps, each one
synchronised on its own (`jax.block_until_ready` of the new state and metrics;
`torch.cuda.synchronize()` before and after on a GPU); the reported step time is the median.
tokens/s = batch x seq / median; MFU = `jaxscale.hardware.mfu` of `cfg.model.flops_per_token(seq)`
x tokens per step, with the plan's compute dtype (`precision.compute_dtype(cfg.plan)`, bf16) and
the mesh's device kind (h200 on a GPU: 989 TFLOP/s dense bf16), the same formula for every side.
The table's ratio is tokens/s over torch.compile's (over torch eager's when compile was not run).

Budget: the default GPU run (h200-0.57b: 567.6M parameters, seq 2048, batch 8; 5 warm-up + 20
timed steps; four sides) is sized to finish in under 5 minutes on one H200 (an estimate until the
first GPU run): each side's process start, compile (jax: ~30-60 s with autotuning, torch.compile:
~1 min) and 25 steps of ~0.12-0.18 s; `wall_s` in results.json records what it took.
Each side is also bounded by `--timeout` (default 240 s): a side that runs past it, crashes or is
refused (an unknown XLA flag aborts XLA) is recorded as failed with its log's tail, the others
still run. Default preset: h200-0.57b when an NVIDIA GPU is visible (`--device auto`), tiny
otherwise; default sides: all four on a GPU, `jax,torch-eager` on a CPU (torch.compile on a CPU
needs a C++ toolchain and minutes; ask for it with --sides).

Outputs under --out (default runs/gpu_step): results.json (config, environment: jax/torch versions
and device names, per-side medians and every step time), step.png (tokens/s per side), the table
printed, one log per side.

The XLA flag preset: every flag below was confirmed to exist with this value by jaxlib's own parser
(an unknown flag or value aborts XLA at start-up): jaxlib 0.10.2 accepts all three and the
command-buffer list (tested by `tests/test_gpu_step.py`), and openxla/xla's
`xla/debug_options_flags.cc` defines them, with defaults latency-hiding scheduler false, Triton
gemm true, command buffers FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN. The preset therefore turns
the latency-hiding scheduler on, keeps Triton gemm on explicitly, and adds WHILE and CONDITIONAL to
the command buffers so that the scan over layers can be captured as one CUDA graph. Not yet run on
a GPU; if the capture of loops misbehaves there, pass e.g.
`--xla-flags "--xla_gpu_enable_latency_hiding_scheduler=true"`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIDES = ("jax", "jax-xla-flags", "jax-unrolled", "torch-eager", "torch-compile")
RESULT_PREFIX = "GPU_STEP_RESULT "
XLA_GPU_PRESET = ("--xla_gpu_enable_latency_hiding_scheduler=true "
                  "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                  "WHILE,CONDITIONAL "
                  "--xla_gpu_enable_triton_gemm=true")
# the README's model (shared/gpu/README.md): 567.6M parameters, 16,384 tokens per step
PRESETS = {
    "h200-0.57b": {"overrides": ["model.dim=2048", "model.n_layers=12", "model.n_heads=16",
                                 "model.n_kv_heads=8", "model.ffn_dim=5632",
                                 "model.vocab_size=320", "model.max_seq_len=2048",
                                 "data.seq_len=2048", "data.batch_size=8"],
                   "warmup": 5, "steps": 20},
    "tiny": {"overrides": ["model.dim=128", "model.n_layers=2", "model.n_heads=4",
                           "model.n_kv_heads=2", "model.ffn_dim=384", "model.vocab_size=320",
                           "model.max_seq_len=64", "data.seq_len=64", "data.batch_size=4"],
             "warmup": 3, "steps": 10},
}
SDPA = ("default", "flash", "efficient", "cudnn", "math")


# ============================================================================ shared helpers
def gpu_visible() -> bool:
    """An NVIDIA GPU on this machine, seen without importing jax or torch (no CUDA context)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            return out.returncode == 0 and "GPU" in out.stdout
        except (OSError, subprocess.SubprocessError):
            return False
    return False


def random_tokens(spec: dict):
    """inputs, targets [batch, seq] int32 of one fixed batch (the same array on every side)."""
    import numpy as np
    rng = np.random.default_rng(spec["seed"])
    tok = rng.integers(0, spec["vocab"], size=(spec["batch"], spec["seq"] + 1), dtype=np.int32)
    return tok[:, :-1].copy(), tok[:, 1:].copy()


def _emit(result: dict) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _summary(times: list[float], warmup: int) -> dict:
    timed = times[warmup:]
    return {"step_times_s": times, "warmup_times_s": times[:warmup], "timed_times_s": timed,
            "median_step_s": statistics.median(timed), "first_step_s": times[0]}


# ============================================================================ workers
def jax_worker(spec: dict, side: str) -> dict:
    import jax
    import numpy as np

    from jaxscale.config import apply_overrides, load_experiment
    from jaxscale.train.setup import build
    backend = jax.default_backend()
    if spec["device"] == "gpu" and backend != "gpu":
        raise RuntimeError(f"--device gpu, but jax's backend is {backend!r} "
                           f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r})")
    overrides = spec["overrides"] + (["model.scan_layers=false"] if side == "jax-unrolled" else [])
    cfg = apply_overrides(load_experiment("llama_tiny"), overrides)
    dev = jax.devices()[0]
    setup = build(cfg, devices=[dev])
    state = setup.init_state()
    inputs, targets = random_tokens(spec)
    batch = jax.device_put({"inputs": inputs, "targets": targets,
                            "mask": np.ones(inputs.shape, np.float32)}, setup.batch_shardings())
    times, losses = [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        state, m = setup.train_step(state, batch)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
        losses.append(float(m["loss"]))
    mem = dev.memory_stats() or {}
    return {"framework": "jax", "backend": backend, "device_name": dev.device_kind,
            "jax_version": jax.__version__, "attention": cfg.model.attention,
            "scan_layers": cfg.model.scan_layers,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "losses": losses,
            "peak_bytes": mem.get("peak_bytes_in_use"), **_summary(times, spec["warmup"])}


def torch_worker(spec: dict, side: str) -> dict:
    import contextlib

    import torch
    import torch.nn.functional as F

    from jaxscale.benchmarks.torch_llama import TorchLlama, TorchLlamaConfig, warmup_cosine_lr
    cuda = spec["device"] == "gpu"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("--device gpu, but torch sees no CUDA device")
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(spec["seed"])
    model = TorchLlama(TorchLlamaConfig(**spec["torch_model"]))
    with torch.no_grad():      # jaxscale's init scale (normal 0.02; norm scales stay 1)
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.02)
    model = model.to(device)
    o = spec["optim"]
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    params = decay + no_decay
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=0.0, betas=(o["b1"], o["b2"]), eps=o["eps"],
                            **({"fused": True} if cuda else {}))
    fwd = torch.compile(model) if side == "torch-compile" else model
    inputs, targets = random_tokens(spec)
    x = torch.from_numpy(inputs).long().to(device)
    y = torch.from_numpy(targets).long().to(device)
    decay_steps = o["decay_steps"] or spec["total_steps"]
    if spec["sdpa"] != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
        attn_ctx = lambda: sdpa_kernel(backend[spec["sdpa"]])  # noqa: E731
    else:
        attn_ctx = contextlib.nullcontext
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(i: int):
        for g in opt.param_groups:
            g["lr"] = warmup_cosine_lr(i, o["lr"], o["warmup_steps"], decay_steps,
                                       o["min_lr_ratio"])
        with torch.autocast(device.type, dtype=torch.bfloat16), attn_ctx():
            logits = fwd(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        if o["clip_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(params, o["clip_norm"], foreach=cuda or None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        sync()
        t0 = time.perf_counter()
        loss = step(i)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"framework": "torch", "backend": device.type,
            "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor()
            or platform.machine(), "torch_version": torch.__version__,
            "attention": f"sdpa:{spec['sdpa']}", "fused_adamw": cuda,
            "compiled": side == "torch-compile", "losses": losses,
            "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            **_summary(times, spec["warmup"])}


def worker_main(side: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        res = (jax_worker if side.startswith("jax") else torch_worker)(spec, side)
        res.update(side=side, status="ok")
    except Exception as e:  # reported to the parent; the traceback is in the side's log
        import traceback
        traceback.print_exc()
        res = {"side": side, "status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
    _emit(res)
    return 0 if res["status"] == "ok" else 1


# ============================================================================ parent
def build_spec(args, device: str) -> tuple[dict, object]:
    from jaxscale.benchmarks.torch_llama import TorchLlamaConfig
    from jaxscale.config import apply_overrides, load_experiment
    p = PRESETS[args.preset]
    warmup = p["warmup"] if args.warmup is None else args.warmup
    steps = p["steps"] if args.steps is None else args.steps
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0 (got {steps}, {warmup})")
    overrides = (["mesh=h200x1" if device == "gpu" else "mesh=cpu1"] + p["overrides"] +
                 ["plan.precision=bf16", f"model.attention={args.jax_attention}",
                  "train.eval_every=0", f"train.steps={warmup + steps}"] + list(args.set))
    cfg = apply_overrides(load_experiment("llama_tiny"), overrides)
    spec = {"preset": args.preset, "device": device, "overrides": overrides, "warmup": warmup,
            "steps": steps, "seed": args.seed, "batch": cfg.data.batch_size,
            "seq": cfg.data.seq_len, "vocab": cfg.model.vocab_size,
            "torch_model": TorchLlamaConfig.from_model_config(cfg.model).to_dict(),
            "optim": dataclasses.asdict(cfg.optim), "total_steps": warmup + steps,
            "sdpa": args.sdpa}
    return spec, cfg


def _child_env(side: str, device: str, xla_flags: str) -> dict:
    env = dict(os.environ)
    # simulated host devices (the test suite's 8) are not part of this benchmark: one device
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if side == "jax-xla-flags":
        flags += xla_flags.split()
    env["XLA_FLAGS"] = " ".join(flags)
    if device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif env.get("JAX_PLATFORMS") == "cpu":
        env.pop("JAX_PLATFORMS")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [
        q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q])
    return env


def run_side(side: str, spec_path: Path, device: str, xla_flags: str, log_path: Path,
             timeout: float) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gpu_step", "--worker", side, "--spec",
           str(spec_path)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=_child_env(side, device, xla_flags),
                                  stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout)
            stdout, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (
                e.stdout or ""), None
    wall = time.perf_counter() - t0
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if lines:
        res = json.loads(lines[-1][len(RESULT_PREFIX):])
    else:
        tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exited with {rc}"
        res = {"side": side, "status": "failed", "error": f"{why} without a result; log tail:\n"
               f"{tail}"}
    res["wall_s"] = wall
    res["log"] = str(log_path)
    return res


def finish(results: list[dict], spec: dict, cfg) -> None:
    """tokens/s, MFU (one formula for all sides) and the ratio to the reference side."""
    from jaxscale import hardware
    from jaxscale.strategies.precision import compute_dtype
    tokens = spec["batch"] * spec["seq"]
    flops = cfg.model.flops_per_token(spec["seq"]) * tokens
    for r in results:
        if r["status"] != "ok":
            continue
        r["tokens_per_step"] = tokens
        r["tokens_per_s"] = tokens / r["median_step_s"]
        r["mfu"] = hardware.mfu(flops, r["median_step_s"], cfg.mesh.device_kind,
                                compute_dtype(cfg.plan), 1, cfg.train.peak_flops)
    ok = {r["side"]: r for r in results if r["status"] == "ok"}
    ref = next((s for s in ("torch-compile", "torch-eager") if s in ok), None)
    for r in results:
        if ref and r["status"] == "ok":
            r["ratio_to"] = ref
            r["ratio"] = r["tokens_per_s"] / ok[ref]["tokens_per_s"]


def format_table(results: list[dict]) -> str:
    ref = next((r["ratio_to"] for r in results if "ratio_to" in r), None)
    head = ("side", "tokens/s", "median step ms", "first step s", "MFU",
            f"x {ref}" if ref else "ratio", "status")
    rows = []
    for r in results:
        if r["status"] == "ok":
            rows.append((r["side"], f"{r['tokens_per_s']:,.0f}", f"{1e3 * r['median_step_s']:.1f}",
                         f"{r['first_step_s']:.1f}", f"{100 * r['mfu']:.1f}%",
                         f"{r['ratio']:.2f}" if "ratio" in r else "-", "ok"))
        else:
            note = r.get("note") or r.get("error", "").splitlines()[0][:70]
            rows.append((r["side"], "-", "-", "-", "-", "-", f"{r['status']}: {note}"))
    widths = [max(len(str(x[i])) for x in [head] + rows) for i in range(len(head))]
    fmt = lambda row: " | ".join(str(c).ljust(w) for c, w in zip(row, widths))  # noqa: E731
    return "\n".join([fmt(head), "-+-".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["side"] for r in ok]
    vals = [r["tokens_per_s"] for r in ok]
    colors = ["tab:blue" if n.startswith("jax") else "tab:orange" for n in names]
    bars = ax.bar(names, vals, color=colors)
    for b, r in zip(bars, ok):
        label = f"{r['tokens_per_s']:,.0f}"
        if "ratio" in r:
            label += f"\n{r['ratio']:.2f}x"
        ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s (median step after warm-up)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, max(vals + [1]) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(results: list[dict]) -> dict:
    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "git_commit": commit,
            "packages": {d: version(d) for d in ("jax", "jaxlib", "jax-cuda13-plugin",
                                                 "jax-cuda12-plugin", "flax", "optax", "torch",
                                                 "triton")},
            "devices": {r["side"]: r.get("device_name") for r in results if r["status"] == "ok"},
            "xla_flags_env": os.environ.get("XLA_FLAGS", "")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="h200-0.57b on a GPU, tiny otherwise")
    p.add_argument("--steps", type=int, default=None, help="timed steps (preset default)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (preset default)")
    p.add_argument("--sides", default=None,
                   help=f"comma-separated of {', '.join(SIDES)} (default: all on a GPU, "
                        f"jax,torch-eager on a CPU)")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    p.add_argument("--xla-flags", default=XLA_GPU_PRESET,
                   help="added to XLA_FLAGS of the jax-xla-flags side")
    p.add_argument("--jax-attention", default="auto", help="model.attention of the JAX sides")
    p.add_argument("--sdpa", choices=SDPA, default="default",
                   help="SDPA backend of the torch sides (default: PyTorch's dispatch)")
    p.add_argument("--set", action="append", default=[],
                   help="extra jaxscale override a.b=c (model.* / data.* apply to torch too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per side")
    p.add_argument("--out", default="runs/gpu_step")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.spec)

    device = args.device if args.device != "auto" else ("gpu" if gpu_visible() else "cpu")
    args.preset = args.preset or ("h200-0.57b" if device == "gpu" else "tiny")
    sides = ([s.strip() for s in args.sides.split(",") if s.strip()] if args.sides else
             list(SIDES) if device == "gpu" else ["jax", "torch-eager"])
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides:
        p.error(f"unknown or no side(s) {bad}; valid: {', '.join(SIDES)}")
    try:
        spec, cfg = build_spec(args, device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(f"gpu_step: preset {args.preset} on {device}, sides {','.join(sides)}, "
        f"{spec['warmup']} warm-up + {spec['steps']} timed steps")
    t_start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="jaxscale_gpu_step_") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for side in sides:
            if side == "jax-xla-flags" and device != "gpu":
                results.append({"side": side, "status": "skipped",
                                "note": "XLA GPU flags mean nothing on a CPU"})
                log(f"[{side}] skipped on CPU")
                continue
            res = run_side(side, spec_path, device, args.xla_flags, out / f"{side}.log",
                           args.timeout)
            results.append(res)
            if res["status"] == "ok":
                log(f"[{side}] median {1e3 * res['median_step_s']:.1f} ms, first step "
                    f"{res['first_step_s']:.1f} s, loss {res['losses'][0]:.3f} -> "
                    f"{res['losses'][-1]:.3f} ({res['wall_s']:.0f} s)")
            else:
                log(f"[{side}] FAILED: {res['error'][:500]}")
    total = time.perf_counter() - t_start
    finish(results, spec, cfg)
    n_params = cfg.model.param_count()
    title = (f"{args.preset}: {n_params / 1e6:.1f}M params, batch {spec['batch']} x seq "
             f"{spec['seq']}, bf16 ({device}: "
             f"{next((r['device_name'] for r in results if r.get('device_name')), '?')})")
    doc = {"preset": args.preset, "device": device, "sides": sides, "wall_s": total,
           "config": {"warmup": spec["warmup"], "steps": spec["steps"], "seed": args.seed,
                      "batch": spec["batch"], "seq": spec["seq"],
                      "tokens_per_step": spec["batch"] * spec["seq"], "params": n_params,
                      "flops_per_token": cfg.model.flops_per_token(spec["seq"]),
                      "jax_overrides": spec["overrides"], "jax_attention": args.jax_attention,
                      "xla_flag_preset": args.xla_flags, "torch_sdpa": args.sdpa,
                      "torch_model": spec["torch_model"], "optim": spec["optim"],
                      "mfu_device_kind": cfg.mesh.device_kind},
           "environment": environment(results), "results": results}
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=str))
    wrote = [out / "results.json"]
    if any(r["status"] == "ok" for r in results):
        plot(results, out / "step.png", title)
        wrote.append(out / "step.png")
    print(title)
    print(format_table(results))
    print(f"\n{total:.0f} s in all; wrote {' and '.join(map(str, wrote))}")
    return 0 if all(r["status"] != "failed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
