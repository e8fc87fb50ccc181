"""python -m benchmarks.matched_training [--pairs dp,fsdp,tp] [--world 8] [--tp-world 4] [--out DIR]

Matched training baselines: jaxscale against the PyTorch way of doing the same thing, on the same
LLaMA, initial weights, batches, optimizer and schedule, in one run. Pairs (PyTorch: a real job of
`world` processes on localhost, set up by `torch_llama.parallelize`; jaxscale: one process, a mesh):
  dp         DistributedDataParallel                            mesh dp=world
  fsdp       FSDP2 `fully_shard` per block, then the root       mesh fsdp=world
  fsdp_keep  the same with reshard_after_forward=False          mesh fsdp=world
  hsdp       FSDP2 on a 2-D (replicate 2, shard world/2) mesh   mesh dp=2 x fsdp=world/2
  tp         DTensor TP (Megatron layout, `loss_parallel`)      mesh tp=world

Sameness: the initial weights are the jaxscale init converted by `benchmarks.torch_llama`; batch i
is `Batches(...).global_rows(i)` on both sides (data-parallel rank r takes rows r*B/n..(r+1)*B/n,
TP ranks take all rows); the loss is the token mean over the global batch (each data-parallel rank
scales its token-sum loss by world/tokens, so DDP's and FSDP2's gradient averaging gives exactly
the global mean); the optimizer is `torch_llama.AdamWLikeOptax`, a term-by-term copy of
`make_optimizer`. PyTorch runs eager (no torch.compile), fp32; jaxscale its jitted train step.
Timing: after `--warmup` untimed steps the two sides take turns in chunks of `--chunk` steps,
order reversed every chunk, so drift hits both; a torch chunk starts after a barrier and lasts
until its slowest rank, a JAX chunk ends with `block_until_ready`. On CPU the JAX devices and the
torch processes share the cores: only the JAX/torch ratio of one run means anything.
Memory per rank: "state" is parameters + Adam moments (exact on both sides); "peak" is, for JAX,
the compiled step's `memory_analysis()` per device (arguments + outputs + temporaries - aliased),
for torch on CPU the peak of live tensor bytes torch's `MemTracker` (`FSDPMemTracker` for FSDP2)
records over one extra step after the run (buffers allocated in C++, such as DDP's buckets, are
not seen), on CUDA `max_memory_allocated`. Collectives: the census of the compiled step beside the
ops torch's `CommDebugMode` counts over one more step. Each rank's peak RSS is in the JSON (it is
mostly the runtime, not the model). On GPUs the torch job uses NCCL, one GPU per rank.
Outputs under --out: matched_training.json and matched_training.png; the tables are printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from jaxscale.benchmarks.matched_report import format_collectives, format_table, plot  # noqa: E402,F401
from jaxscale.comm.torch_bench import TorchFailure, TorchJob, _free_port

REPO = Path(__file__).resolve().parent.parent
PAIRS = {"dp": ("DDP", "jaxscale DP"), "fsdp": ("FSDP2", "jaxscale FSDP"),
         "fsdp_keep": ("FSDP2 no reshard", "jaxscale FSDP"),
         "hsdp": ("FSDP2 HSDP", "jaxscale dp x fsdp"), "tp": ("DTensor TP", "jaxscale TP")}
DATA_PARALLEL = ("dp", "fsdp", "fsdp_keep", "hsdp")


# ============================================================================ torch worker
def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        loc = t.to_local() if hasattr(t, "to_local") else t
        total += loc.numel() * loc.element_size()
    return total


def _tracked_step(step, model, optimizer, mode: str) -> tuple[int, dict]:
    """Peak live tensor bytes of one step, from torch's MemTracker (FSDPMemTracker for FSDP2,
    which also sees its all-gather and reduce-scatter buffers). Buffers allocated inside C++
    (DDP's gradient buckets, gloo's staging) are not tensors it sees."""
    if mode in ("fsdp", "fsdp_keep", "hsdp"):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        tracker = FSDPMemTracker(model, optimizer)
    else:
        from torch.distributed._tools.mem_tracker import MemTracker
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    with tracker:
        step()
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return int(snap["Total"]), {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


class Trainer:
    """One pair's torch side on one rank: model, strategy, optimizer and its share of the data."""

    def __init__(self, spec: dict, rank: int, world: int, device):
        import torch

        from jaxscale.benchmarks.torch_llama import (
            AdamWLikeOptax,
            TorchLlama,
            TorchLlamaConfig,
            parallelize,
        )
        self.mode, self.device, self.world = spec["mode"], device, world
        model = TorchLlama(TorchLlamaConfig(**spec["model"]))
        with np.load(spec["init"]) as init:
            model.load_state_dict({k: torch.from_numpy(init[k]) for k in init.files})
        self.model = parallelize(model.to(device), self.mode, world, device.type, spec["hsdp_dp"])
        self.inner = self.model.module if self.mode == "dp" else self.model
        self.opt = AdamWLikeOptax(self.inner.named_parameters(), spec["optim"],
                                  spec["total_steps"])
        with np.load(spec["batches"]) as data:
            self.inputs, self.targets, self.mask = data["inputs"], data["targets"], data["mask"]
        per = self.inputs.shape[1] // world
        dp = self.mode in DATA_PARALLEL
        self.rows = slice(rank * per, (rank + 1) * per) if dp else slice(None)
        self.ntok = np.maximum(self.mask.sum(axis=(1, 2)), 1.0)
        self.loss_scale = world if dp else 1     # DDP / FSDP2 average the ranks' gradients

    def step(self, i: int):
        """Train on global batch i; returns (this rank's token-sum loss, grad norm)."""
        import torch
        import torch.nn.functional as F
        r, dev = self.rows, self.device
        x = torch.from_numpy(self.inputs[i, r]).long().to(dev)
        y = torch.from_numpy(self.targets[i, r]).long().to(dev)
        y = y.masked_fill(torch.from_numpy(self.mask[i, r] == 0).to(dev), -100)
        logits = self.model(x)
        if self.mode == "tp":      # vocab-sharded logits: cross-entropy without gathering them
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                s = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
                (s * (1.0 / self.ntok[i])).backward()
            s = s.to_local()
        else:
            s = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            (s * (self.loss_scale / self.ntok[i])).backward()
        return s.detach(), self.opt.step()

    def steps(self, start: int, n: int, sync) -> dict:
        import torch
        import torch.distributed as dist
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        out = [self.step(i) for i in range(start, start + n)]
        sync()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)     # a chunk lasts until its slowest rank
        sums = torch.stack([s for s, _ in out]).double()
        if self.mode in DATA_PARALLEL:
            dist.all_reduce(sums)
        losses = sums.cpu().numpy() / self.ntok[start:start + n]
        return {"time": float(elapsed), "loss": losses.tolist(), "grad_norm": [g for _, g in out]}

    def stats(self) -> dict:
        import torch
        mine = {"params_bytes": _local_bytes(self.inner.parameters()),
                "opt_bytes": self.opt.state_bytes(),
                "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.device.type == "cuda":
            mine["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        else:   # one more step (the last batch again) under a tensor memory tracker
            mine["peak_bytes"], mine["peak_breakdown"] = _tracked_step(
                lambda: self.step(len(self.inputs) - 1), self.model, self.opt.opt, self.mode)
        from torch.distributed.tensor.debug import CommDebugMode
        with CommDebugMode() as comm:        # the collectives of one more step, by op
            self.step(len(self.inputs) - 1)
        mine["collectives"] = {str(k): int(v) for k, v in comm.get_comm_counts().items()}
        return mine


def worker() -> None:
    """One rank: env RANK, WORLD_SIZE, MASTER_ADDR/PORT; JSON requests on stdin (setup with a
    spec file, steps, stats, exit); rank 0 answers `RESULT <json>` on stdout."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = os.environ.get("JAXSCALE_TORCH_BACKEND", "gloo")
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(backend, timeout=timedelta(
        seconds=float(os.environ.get("JAXSCALE_TORCH_TIMEOUT", "300"))))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.barrier()
    if rank == 0:
        print("READY", flush=True)
    trainer = None
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "exit":
            break
        if req["cmd"] == "setup":
            trainer = None                       # free the previous pair first
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            trainer = Trainer(json.loads(Path(req["spec"]).read_text()), rank, world, device)
            dist.barrier()
            reply = {"ok": True}
        elif req["cmd"] == "steps":
            reply = trainer.steps(req["start"], req["n"], sync)
        elif req["cmd"] == "stats":
            reply = [None] * world
            dist.all_gather_object(reply, trainer.stats())
        else:
            raise ValueError(f"unknown request {req}")
        if rank == 0:
            print("RESULT " + json.dumps(reply), flush=True)
    dist.destroy_process_group()


class TrainJob(TorchJob):
    """`world` torch ranks running `worker()`; `TorchJob`'s bounded waits and error reporting."""

    def __init__(self, world: int, backend: str, timeout: float):
        self.world, self.backend, self.timeout = world, backend, timeout
        self.logdir = Path(tempfile.mkdtemp(prefix="jaxscale_train_"))
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1", JAXSCALE_TORCH_BACKEND=backend,
                   JAXSCALE_TORCH_TIMEOUT=str(timeout),
                   PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get(
                       "PYTHONPATH", "").split(os.pathsep) if p]))
        code = "from jaxscale.benchmarks.matched_training import worker; worker()"
        self.procs, self._lines = [], queue.Queue()
        for r in range(world):
            with open(self.logdir / f"rank{r}.log", "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", code], env=dict(env, RANK=str(r)), text=True,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stderr=log))
        threading.Thread(target=self._read, daemon=True).start()

    def wait_ready(self) -> None:
        self._expect("READY")

    def request(self, **req):
        self._send(req)
        return json.loads(self._expect("RESULT"))


# ============================================================================ JAX side and pairs
def pair_config(base, mode: str, world: int, hsdp_dp: int = 2):
    from jaxscale.config import apply_overrides
    deg = {"dp": (world, 1, 1), "fsdp": (1, world, 1), "fsdp_keep": (1, world, 1),
           "tp": (1, 1, world), "hsdp": (hsdp_dp, world // hsdp_dp, 1)}[mode]
    return apply_overrides(base, [f"mesh.{a}={d}" for a, d in zip(("dp", "fsdp", "tp"), deg)] +
                           ["plan.zero=0", "plan.accumulate=1", "plan.precision=fp32"])


def global_batches(cfg, steps: int) -> dict[str, np.ndarray]:
    from jaxscale.data import Batches, load_corpus
    b = Batches(load_corpus(cfg.data).train, cfg.data.batch_size, cfg.data.seq_len,
                seed=cfg.data.seed)
    rows = [b.global_rows(i) for i in range(steps)]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def initial_params(cfg):
    import jax

    from jaxscale.train.state import FunctionalModel
    return jax.device_get(jax.jit(FunctionalModel(cfg.model).init)(
        jax.random.key(cfg.train.seed)))


def run_pairs(modes, base_cfg, world: int, steps: int, *, warmup: int = 2, chunk: int = 2,
              backend: str = "gloo", timeout: float = 300.0, hsdp_dp: int = 2,
              log=None) -> list[dict]:
    """Train `steps` steps of each jaxscale strategy in `modes` and of its PyTorch counterpart (one
    torch job of `world` ranks serves every pair in turn); see the module docstring."""
    import shutil

    import jax

    from jaxscale.interop.hf_tensors import params_to_hf
    from jaxscale.plan import validate
    log = log or (lambda s: None)
    if len(jax.devices()) < world:
        raise ValueError(f"world={world} needs {world} JAX devices, {len(jax.devices())} present")
    base_cfg = dataclasses.replace(base_cfg, train=dataclasses.replace(base_cfg.train, steps=steps))
    for mode in modes:                 # every plan checked before any process starts
        validate(pair_config(base_cfg, mode, world, hsdp_dp), world)
    if "tp" in modes and base_cfg.model.tie_embeddings:
        raise ValueError("the DTensor TP baseline needs an untied head: model.tie_embeddings=0")
    tmp = Path(tempfile.mkdtemp(prefix="jaxscale_matched_"))
    data = global_batches(base_cfg, steps)
    init = initial_params(base_cfg)
    np.savez(tmp / "init.npz", **params_to_hf(init, base_cfg.model))
    np.savez(tmp / "batches.npz", **data)
    log(f"starting {world} torch ranks ({backend})")
    job = TrainJob(world, backend, timeout)
    try:
        results = []
        for k, mode in enumerate(modes):
            results.append(_run_one(job, mode, base_cfg, world, steps, init, data, tmp, warmup,
                                    chunk, hsdp_dp, wait_ready=(k == 0), log=log))
    finally:
        job.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _run_one(job, mode, base_cfg, world, steps, init, data, tmp, warmup, chunk, hsdp_dp,
             wait_ready, log) -> dict:
    import jax

    from jaxscale.analysis.inspect import census, memory
    from jaxscale.benchmarks.torch_llama import TorchLlamaConfig
    from jaxscale.train.setup import build
    from jaxscale.train.state import TrainState, state_bytes
    cfg = pair_config(base_cfg, mode, world, hsdp_dp)
    spec = {"mode": mode, "hsdp_dp": hsdp_dp, "total_steps": steps,
            "model": TorchLlamaConfig.from_model_config(cfg.model).to_dict(),
            "optim": dataclasses.asdict(cfg.optim),
            "init": str(tmp / "init.npz"), "batches": str(tmp / "batches.npz")}
    (tmp / f"spec_{mode}.json").write_text(json.dumps(spec))
    log(f"[{mode}] compiling the jaxscale step; setting up {PAIRS[mode][0]}")
    if wait_ready:
        job.wait_ready()
    job._send({"cmd": "setup", "spec": str(tmp / f"spec_{mode}.json")})   # torch builds meanwhile
    setup = build(cfg, jax.devices()[:world], donate=True)
    sh = setup.state_shardings          # the fp32 state of the jaxscale init, no init program
    state = TrainState(step=jax.device_put(np.zeros((), np.int32), sh.step),
                       params=jax.device_put(init, sh.params),
                       opt_state=jax.device_put(setup.optimizer.init(init), sh.opt_state))
    with jax.set_mesh(setup.placement.mesh):
        compiled = setup.lower_train_step().compile()
    shard = setup.batch_shardings()
    job._expect("RESULT")
    jax_metrics, torch_out = [], {"loss": [], "grad_norm": []}

    def jax_chunk(start, n):
        nonlocal state
        t0 = time.perf_counter()
        for i in range(start, start + n):
            batch = {k: jax.make_array_from_process_local_data(shard[k], data[k][i]) for k in shard}
            state, m = compiled(state, batch)
            jax_metrics.append(m)
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    def torch_chunk(start, n):
        r = job.request(cmd="steps", start=start, n=n)
        torch_out["loss"] += r["loss"]
        torch_out["grad_norm"] += r["grad_norm"]
        return r["time"]

    warm = min(warmup, steps - 1)
    jax_chunk(0, warm)
    torch_chunk(0, warm)
    times = {jax_chunk: 0.0, torch_chunk: 0.0}
    k, i = 0, warm
    while i < steps:        # alternate, order reversed every chunk
        n = min(chunk, steps - i)
        for side in ((jax_chunk, torch_chunk) if k % 2 == 0 else (torch_chunk, jax_chunk)):
            times[side] += side(i, n)
        i, k = i + n, k + 1
    stats = job.request(cmd="stats")
    mets = jax.device_get(jax_metrics)
    timed, tokens = steps - warm, cfg.data.batch_size * cfg.data.seq_len
    jmem = memory(compiled)
    sb = state_bytes(setup.abstract_state())
    jl, tl = [float(m["loss"]) for m in mets], torch_out["loss"]
    res = {
        "pair": mode, "torch_name": PAIRS[mode][0], "jax_name": PAIRS[mode][1], "world": world,
        "backend": job.backend, "steps": steps, "timed_steps": timed, "tokens_per_step": tokens,
        "mesh": dict(zip(setup.placement.mesh.axis_names,
                         map(int, setup.placement.mesh.devices.shape))),
        "jax": {"step_time_s": times[jax_chunk] / timed,
                "tokens_per_s": tokens * timed / times[jax_chunk],
                "loss": jl, "grad_norm": [float(m["grad_norm"]) for m in mets],
                "state_bytes_per_device": sum(sum(sb.get(p, {}).values())
                                              for p in ("params", "opt_state")),
                "peak_bytes_per_device": jmem["total"], "memory_analysis": jmem,
                "census": census(compiled.as_text(), setup.placement.mesh)},
        "torch": {"step_time_s": times[torch_chunk] / timed,
                  "tokens_per_s": tokens * timed / times[torch_chunk],
                  "loss": tl, "grad_norm": torch_out["grad_norm"],
                  "state_bytes_per_rank": [s["params_bytes"] + s["opt_bytes"] for s in stats],
                  "peak_bytes_per_rank": [s["peak_bytes"] for s in stats],
                  "peak_kind": "cuda max_memory_allocated" if job.backend == "nccl" else
                  "MemTracker peak tensor bytes", "collectives": stats[0]["collectives"],
                  "ranks": stats},
    }
    res["ratio_tokens_per_s"] = res["jax"]["tokens_per_s"] / res["torch"]["tokens_per_s"]
    res["loss_abs_diff"] = [abs(a - b) for a, b in zip(jl, tl)]
    res["final_loss_abs_diff"] = res["loss_abs_diff"][-1]
    log(f"[{mode}] done: JAX/torch tokens/s {res['ratio_tokens_per_s']:.2f}, "
        f"final loss {jl[-1]:.5f} vs {tl[-1]:.5f}")
    return res


# ============================================================================ report
def base_config(args):
    from jaxscale import models
    from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig, apply_overrides
    model = dataclasses.replace(models.get(args.model), n_layers=args.layers)
    cfg = Config(name="matched_training", model=model,
                 data=DataConfig(seq_len=args.seq, batch_size=args.batch, max_bytes=2_000_000),
                 optim=OptimConfig(lr=args.lr, warmup_steps=max(1, args.steps // 10)),
                 train=TrainConfig(steps=args.steps, eval_every=0))
    return apply_overrides(cfg, args.set)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="dp,fsdp,tp", help=f"comma-separated of {', '.join(PAIRS)}")
    p.add_argument("--world", type=int, default=8, help="ranks = JAX devices per pair")
    p.add_argument("--tp-world", type=int, default=4,
                   help="ranks of the tp pair (tp must divide the KV heads: 4 in `tiny`; "
                        "--tp-world 8 with --set model.n_kv_heads=8)")
    for flag, default in (("steps", 20), ("warmup", 2), ("chunk", 2), ("layers", 4), ("seq", 128),
                          ("batch", 16)):     # batch: global, in sequences
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--model", default="tiny")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--set", action="append", default=[], help="config override a.b=c")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", default="runs/matched_training")
    args = p.parse_args(argv)
    pairs = [s.strip() for s in args.pairs.split(",") if s.strip()]
    bad = [s for s in pairs if s not in PAIRS]
    if bad:
        p.error(f"unknown pair(s) {bad}; valid: {', '.join(PAIRS)}")
    from jaxscale.hardware import simulate_cpu_devices
    simulate_cpu_devices(max(8, args.world, args.tp_world))
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # leave GPU memory to torch
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    backend = args.backend if args.backend != "auto" else (
        "nccl" if jax.default_backend() == "gpu" else "gloo")
    cfg = base_config(args)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    worlds = {m: args.tp_world if m == "tp" else args.world for m in pairs}
    results = []
    try:
        for world in dict.fromkeys(worlds.values()):
            results += run_pairs([m for m in pairs if worlds[m] == world], cfg, world, args.steps,
                                 warmup=args.warmup, chunk=args.chunk, backend=backend,
                                 timeout=args.timeout, log=log)
    except TorchFailure as e:
        print(f"the torch side failed: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv[1:] if argv is None else argv, "jax_backend": jax.default_backend(),
            "model": dataclasses.asdict(cfg.model), "data": dataclasses.asdict(cfg.data),
            "optim": dataclasses.asdict(cfg.optim), "cpu_count": os.cpu_count()}
    (out / "matched_training.json").write_text(json.dumps({"meta": meta, "results": results},
                                                          indent=2, default=str))
    plot(results, out / "matched_training.png")
    print(format_table(results))
    print()
    print(format_collectives(results))
    print(f"\nwrote {out / 'matched_training.json'} and {out / 'matched_training.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
