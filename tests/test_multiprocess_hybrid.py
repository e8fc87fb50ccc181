"""Two processes x 4 CPU devices over a hybrid mesh (jax.distributed, gloo): dp across the
processes (`mesh.dcn_dp=2`, the DCN-like outer level), fsdp=4 inside each (the ICI-like inner
level). The census of the compiled step shows the two levels: the gradient all-reduce over dp
crosses processes, the parameter all-gathers and gradient reductions over fsdp stay inside one;
it equals the census of the same plan on 8 devices of one process grouped into 2 simulated nodes,
and the plan's formulas; the step runs and gives that run's loss."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxscale import launch
from jaxscale.analysis import inspect
from jaxscale.data import Batches, load_corpus
from jaxscale.train.setup import build
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "fixtures" / "hybrid_census.py"
HYBRID = ("mesh.dp=2", "mesh.dcn_dp=2", "mesh.fsdp=4", "mesh.tp=1")


@pytest.fixture(scope="module")
def results():
    port = launch.free_port()
    procs = []
    for i in range(2):
        env = launch._child_env(i, 2, port, local_devices=4, heartbeat=30, prefix="")
        env["PYTHONPATH"] = str(ROOT)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), *HYBRID], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=300)
            assert p.returncode == 0, text[-3000:]
            (line,) = [x for x in text.splitlines() if x.startswith("RESULT ")]
            out.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


@pytest.fixture(scope="module")
def one_process():
    """The same plan in this process: 8 devices grouped into 2 simulated nodes of 4."""
    cfg = tiny_config(*HYBRID)
    setup = build(cfg)
    comp = setup.lower_train_step().compile()
    batch = Batches(load_corpus(cfg.data).train, cfg.data.batch_size, cfg.data.seq_len,
                    seed=0).device_batch(0, setup.batch_shardings())
    _, m = comp(setup.init_state(), batch)
    return inspect.census(comp.as_text(), setup.placement.mesh), float(m["loss"])


def _rows(census, kind, axes):
    return [c for c in census if c["kind"] == kind and c["axes"] == axes]


def test_hybrid_mesh_census_shows_the_two_levels(results):
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert r["crosses"]["dp"] and not r["crosses"]["fsdp"], r["crosses"]
        census = r["census"]
        assert _rows(census, "all-reduce", ["dp"])          # gradients: across processes
        assert _rows(census, "all-gather", ["fsdp"])        # parameters: inside a process
        # XLA:CPU's gradient reduce-scatter over fsdp (all-reduce + slice): inside a process
        assert _rows(census, "all-reduce", ["fsdp"])
        assert not [c for c in census if c["kind"] == "all-gather" and "dp" in c["axes"]]
        for row in r["theory"]:
            assert row["ratio"] is not None and abs(row["ratio"] - 1) < 0.02, row
    assert results[0]["census"] == results[1]["census"]


def test_two_processes_match_simulated_nodes(results, one_process):
    census, loss = one_process
    assert results[0]["census"] == census
    for r in results:
        assert r["loss"] == pytest.approx(loss, rel=1e-5)
