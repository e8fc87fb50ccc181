"""The nvme tier's host RAM: the offloaded state stays out of the process's RSS (each tier in a
process of its own, so that one's memory is not another's)."""

RSS_PROBE = r'''
import json, sys, tempfile
import jax
from tests.helpers import tiny_config
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


def _rss(*tiers_: str) -> list[dict]:
    """Each tier's RSS figures, from a process of its own (started together)."""
    import json
    import os
    import subprocess
    import sys
    env = {**os.environ, "MALLOC_ARENA_MAX": "1",        # one heap: freed memory is reusable
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen([sys.executable, "-c", RSS_PROBE, tier], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
             for tier in tiers_]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_nvme_keeps_the_offloaded_state_out_of_host_ram():
    """An 11.8M-parameter model (a 134 MB store: fp32 moments and master) trained in a process
    of its own on the host tier and on the nvme tier: between steps the nvme run's RSS is below
    the host tier's by at least 80% of the store (measured 164 MB less: only the working
    parameters stay), and its peak during a step is no higher (534 against 628 MB: the pieces
    in flight replace the resident state; the rest of the peak is the forward and backward's own
    buffers, which on XLA:CPU are host RAM too and grow with the model on every tier)."""
    host, nvme = _rss("host", "nvme")
    assert nvme["store"] > 120 * 2 ** 20
    assert nvme["resident"] - nvme["base"] <= host["resident"] - host["base"] - 0.8 * nvme["store"]
    assert nvme["peak"] - nvme["base"] <= 1.05 * (host["peak"] - host["base"])
