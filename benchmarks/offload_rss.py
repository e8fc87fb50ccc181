"""The nvme offload tier's effect on the process's resident memory (RSS), beside the host tier's.

    python -m benchmarks.offload_rss --out runs/offload_rss

An 11.8M-parameter LLaMA (a 134 MB store: fp32 moments and master) is trained 2 steps on one
CPU device, once per tier, each in a process of its own, one after the other (so that neither
run's memory or load is the other's). Per tier: the RSS growth between steps (from just before
the state is made to just after step 1, freed heap returned first: `reset_host_peak`) and the
peak growth during step 2 (VmHWM), beside the store's bytes (`tiers.store_bytes`). Measured on
a 2-core CPU machine: the nvme run's RSS between steps below the host tier's by more than the
store (164 MB less: only the working parameters stay), its peak no higher (534 against 628 MB;
the rest of the peak is the forward and backward's own buffers, which on XLA:CPU are host RAM
on every tier). RSS depends on the allocator and on the process's other contents, so the tests
assert what the tiers hold instead (`tests/test_offload_rss.py`). Writes `offload_rss.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = r'''
import json, sys, tempfile
import jax
from jaxscale.analysis.validation import tiny_config
from jaxscale.analysis.profiling import host_status as status, reset_host_peak as trim
from jaxscale.data import Batches, load_corpus
from jaxscale.plan import Spec
from jaxscale.strategies.offload import tiers
from jaxscale.train.setup import build

ov = ["mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1", "plan.precision=bf16",
      "plan.offload=optimizer+master", "model.dim=384", "model.ffn_dim=1152",
      "model.n_layers=6", "model.n_heads=6", "model.n_kv_heads=6", "data.seq_len=16"]
if sys.argv[1] == "nvme":
    ov += ["plan.offload_tier=nvme", "plan.offload_dir=" + tempfile.mkdtemp()]
cfg = tiny_config(*ov)
setup = build(cfg, jax.devices()[:1])
trim()
base = status("VmRSS")
state = setup.init_state()
step = (setup.train_step if getattr(setup.train_step, "host_driven", False)
        else setup.lower_train_step().compile())
rows = Batches(load_corpus(cfg.data).train, 8, 16, seed=0)
for i in range(2):
    if i == 1:
        trim()
        resident = status("VmRSS")
    batch = {k: jax.device_put(v, setup.batch_shardings()[k])
             for k, v in rows.global_rows(i).items()}
    state, m = step(state, batch)
    float(m["loss"])
print(json.dumps({"base": base, "resident": resident, "peak": status("VmHWM"),
                  "store": tiers.store_bytes(Spec.from_config(cfg))}))
'''
TIERS = ("host", "nvme")


def measure(tier: str) -> dict:
    """One tier's RSS figures (bytes), from a process of its own."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "1",        # one heap: freed memory is reusable
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", PROBE, tier], capture_output=True, text=True,
                       env=env, cwd=Path(__file__).resolve().parents[1], timeout=900)
    if r.returncode:
        raise RuntimeError(f"the {tier} tier's probe failed:\n{r.stderr[-3000:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return {"tier": tier, "store": got["store"], "resident": got["resident"] - got["base"],
            "peak": got["peak"] - got["base"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/offload_rss")
    args = ap.parse_args(argv)
    rows = [measure(t) for t in TIERS]
    mb = 2 ** 20
    print(f"{'tier':6} {'store MB':>9} {'RSS between steps MB':>21} {'peak in a step MB':>18}")
    for r in rows:
        print(f"{r['tier']:6} {r['store'] / mb:9.1f} {r['resident'] / mb:21.1f} "
              f"{r['peak'] / mb:18.1f}")
    host, nvme = rows
    saved = (host["resident"] - nvme["resident"]) / nvme["store"]
    print(f"nvme keeps {saved:.2f} x the store out of RSS between steps; peak nvme / host "
          f"{nvme['peak'] / host['peak']:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload_rss.json").write_text(json.dumps(
        {"rows": rows, "saved_fraction_of_store": saved}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
