"""The offload tiers (`plan.offload_tier=nvme`, `plan.offload_update=host`, `plan.offload_delay`).

On the tiny model (2 layers) and the 8 simulated CPU devices:
- nvme: three steps give the host tier's losses, working parameters and moments bit for bit,
  and its fp32 master bit for bit after the first step (later to one rounding at the leaf's
  scale: XLA:CPU compiles the last multiply-add of the update differently inside the host
  tier's layer loop than in the per-piece program); the bytes read from and written to disk,
  and over the host link, equal `tiers`' formulas; a run killed (SIGKILL) in the middle of a
  step's update resumes from its Orbax checkpoint to the uninterrupted run's losses;
- host update: the first step is the device update bit for bit; the delayed update applies the
  gradient of step s taken at the parameters after s - 1 updates;
- bad input: a missing or unwritable directory, too little free disk, and the impossible
  combinations, each refused before anything is written, naming the field and the fix.
"""
import functools
import os
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple

import jax
import numpy as np
import pytest

from jaxscale import plan as plan_lib
from jaxscale.data import Batches, load_corpus
from jaxscale.plan import Spec
from jaxscale.strategies.offload import store as store_lib
from jaxscale.strategies.offload import tiers
from jaxscale.train.setup import build
from tests.helpers import tiny_config

BASE = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", "plan.precision=bf16",
        "plan.offload=optimizer+master")
NVME = ("plan.offload_tier=nvme",)
HOST = ("plan.offload_update=host",)
NOWARM = ("optim.warmup_steps=0",)       # step 0 changes the parameters (warm-up's lr is 0)


@functools.lru_cache(maxsize=None)
def _nvme_dir():
    import tempfile
    return tempfile.mkdtemp(prefix="jaxscale-test-nvme-")


def _cfg(*ov, **kw):
    extra = (f"plan.offload_dir={_nvme_dir()}",) if "plan.offload_tier=nvme" in ov else ()
    return tiny_config(*BASE, *ov, *extra, **kw)


@functools.lru_cache(maxsize=None)
def _batches():
    return Batches(load_corpus(tiny_config().data).train, 8, 32, seed=0)


def _batch(setup, i):
    return {k: jax.device_put(v, setup.batch_shardings()[k])
            for k, v in _batches().global_rows(i).items()}


Run = namedtuple("Run", "losses states counted setup")


@functools.lru_cache(maxsize=None)
def _run(ov, steps):
    setup = build(_cfg(*ov))
    state, losses, states, counted = setup.init_state(), [], [], []
    for i in range(steps):
        if hasattr(setup.train_step, "reset_counts"):
            setup.train_step.reset_counts()
        state, m = setup.train_step(state, _batch(setup, i))
        losses.append(float(m["loss"]))
        if hasattr(setup.train_step, "counted"):
            counted.append(setup.train_step.counted())
        states.append(jax.tree.map(lambda x: np.asarray(x.astype(np.float32)),
                                   setup.full_state(state)))
    return Run(losses, states, counted, setup)


def _diff(a, b, part):
    return sum(int(np.sum(x != y)) for x, y in zip(jax.tree.leaves(getattr(a, part)),
                                                   jax.tree.leaves(getattr(b, part))))


def _one_ulp(a, b, part):
    for x, y in zip(jax.tree.leaves(getattr(a, part)), jax.tree.leaves(getattr(b, part))):
        # one rounding of the last add (master + update): an ulp of the leaf's largest value
        assert np.max(np.abs(x - y)) <= 2 ** -23 * np.max(np.abs(x)), part
    return True


def _params_follow_master(a, b):
    """The 16-bit parameters are the master's cast: they differ only where the master took its
    last add's other rounding, and then by one bf16 ulp."""
    leaves = lambda s, part: jax.tree.leaves(getattr(s, part))
    for x, y, u, v in zip(leaves(a, "params"), leaves(b, "params"), leaves(a, "master"),
                          leaves(b, "master")):
        d = x != y
        assert not np.any(d & (u == v)), "parameters differ where the master does not"
        assert np.all(np.abs(x - y)[d] <= 2 ** -7 * np.abs(x)[d]), "more than a bf16 ulp"
    return True


# ----------------------------------------------------------------------------- nvme
def test_nvme_steps_are_the_host_tier_steps_and_move_the_formula_bytes():
    ref, got = _run((), 3), _run(NVME, 3)
    assert got.losses == ref.losses
    for i, (a, b) in enumerate(zip(ref.states, got.states)):
        assert _diff(a, b, "opt_state") == 0, i
        if i == 0:
            assert _diff(a, b, "master") == 0 and _diff(a, b, "params") == 0
        else:
            assert _one_ulp(a, b, "master") and _params_follow_master(a, b), i
    spec = got.setup.placement.spec
    disk, link = tiers.disk_bytes(spec), tiers.host_link_bytes(spec)
    assert disk["read"] == tiers.store_bytes(spec) > 12 * tiers.psi(spec)
    for c in got.counted:
        assert (c["disk_read"], c["disk_written"]) == (disk["read"], disk["written"])
        assert (c["link_in"], c["link_out"]) == (link["in"], link["out"])
    # the store is a working store: its files live under plan.offload_dir while the run lives
    assert any(n.startswith("jaxscale-offload-") for n in os.listdir(_nvme_dir()))


def test_host_update_first_step_is_the_device_update_and_moves_the_formula_bytes():
    ref, got = _run((), 1), _run(HOST, 1)
    assert got.losses == ref.losses
    for part in ("params", "opt_state", "master"):
        assert _diff(ref.states[0], got.states[0], part) == 0, part
    link = tiers.host_link_bytes(got.setup.placement.spec)
    assert (got.counted[0]["link_in"], got.counted[0]["link_out"]) == (link["in"], link["out"])
    assert got.counted[0]["disk_read"] == 0


def test_host_update_steps_a_routing_bias_by_its_sign_rule():
    """A mixture's routing biases take DeepSeek-V3's -rate x sign step on the host too: the
    first step equals the device update's, bit for bit, biases included."""
    moe = ("model.moe_experts=4", "model.moe_bias_rate=0.01", "model.moe_dropless=true")
    ref, got = _run(moe, 1), _run((*moe, *HOST), 1)
    assert got.losses == ref.losses
    for part in ("params", "opt_state", "master"):
        assert _diff(ref.states[0], got.states[0], part) == 0, part
    bias = got.states[0].master["layers"]["mlp"]["router_bias"]
    assert np.abs(bias).max() > 0


def test_delayed_update_reads_parameters_one_step_stale():
    """DPU: step 1's gradient is taken at the initial parameters (step 0's update still runs),
    then applied after step 0's; the same two updates computed by hand agree bit for bit."""
    setup = build(_cfg(*HOST, *NOWARM, "plan.offload_delay=true"))
    state = setup.init_state()
    state, m0 = setup.train_step(state, _batch(setup, 0))
    state, m1 = setup.train_step(state, _batch(setup, 1))
    delayed = setup.full_state(state)
    hand = build(_cfg(*HOST, *NOWARM))
    drv, s0 = hand.train_step, hand.init_state()
    n0, g0, norm0, f0, h0 = drv._grads(s0, _batch(hand, 0))
    n1, g1, norm1, f1, h1 = drv._grads(n0, _batch(hand, 1))     # at p0: one step stale
    p1 = drv._update(g0, norm0, f0, n0.params)
    p2 = drv._update(g1, norm1, f1, p1)
    assert (float(m0["loss"]), float(m1["loss"])) == (float(h0["loss"]), float(h1["loss"]))
    assert float(m1["loss"]) != _run((*HOST, *NOWARM), 2).losses[1]   # not the undelayed one
    for a, b in zip(jax.tree.leaves(delayed.params), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a.astype(np.float32)),
                                      np.asarray(b.astype(np.float32)))


# ----------------------------------------------------------------------------- bad input
def _problems(*ov):
    return plan_lib.problems(Spec.from_config(tiny_config(*BASE, *ov)))


def test_bad_inputs_name_the_field_and_the_fix(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    [e] = [p for p in _problems(*NVME, f"plan.offload_dir={missing}") if "offload_dir" in p]
    assert "does not exist" in e and "mkdir -p" in e and not missing.exists()
    [e] = [p for p in _problems(*NVME, "plan.offload_dir=/proc") if "offload_dir" in p]
    assert "not writable" in e
    [e] = [p for p in _problems(*NVME) if "offload_dir" in p]
    assert "is empty" in e
    free = namedtuple("usage", "total used free")(10, 10, 1000)
    monkeypatch.setattr(store_lib.shutil, "disk_usage", lambda _: free)
    [e] = [p for p in _problems(*NVME, f"plan.offload_dir={tmp_path}") if "offload_dir" in p]
    spec = Spec.from_config(tiny_config(*BASE, *NVME))
    assert "free" in e and f"{tiers.store_bytes(spec):,}" in e and not os.listdir(tmp_path)
    assert any("plan.offload_update=host" in p for p in _problems("plan.offload_delay=true"))
    none = ("plan.offload=none", "plan.offload_update=host")
    assert any("offloads nothing" in p for p in plan_lib.problems(Spec.from_config(
        tiny_config(*BASE[:4], *none))))
    assert any("optim.kind=adamw" in p for p in _problems(*HOST, "optim.kind=sgd"))


# ----------------------------------------------------------------------------- kill -9
def test_kill_mid_step_then_resume_gives_the_uninterrupted_losses(tmp_path):
    from jaxscale.train.loop import train
    from jaxscale.train.metrics import read_metrics
    ov = (*NVME, "train.steps=4", "ckpt.every=2", "ckpt.async_save=false", "train.log_every=1")
    killed = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        import tests.conftest
        from jaxscale.strategies.offload import store
        from jaxscale.train.loop import train
        from tests.test_offload_tiers import _cfg
        streams, write, stream = [0, 0], store.Store.write, store.Store.stream
        def dying(self, k, value, layer=None):
            if streams[0] == 3:                             # step 3's update
                streams[1] += 1
                if streams[1] == 3:                         # its third piece's leaves
                    os.kill(os.getpid(), signal.SIGKILL)
            return write(self, k, value, layer)
        def counting(self, *a):
            streams[0] += 1
            return stream(self, *a)
        store.Store.write, store.Store.stream = dying, counting
        train(_cfg(*{ov!r}), {str(tmp_path / "a")!r}, progress=False)
    """)
    p = subprocess.run([sys.executable, "-c", killed], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == -9, p.stderr[-3000:]
    assert (tmp_path / "a" / "checkpoints" / "2").exists()
    train(_cfg(*ov), tmp_path / "a", progress=False, resume=True)
    train(_cfg(*ov), tmp_path / "b", progress=False)
    got = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    ref = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert len(ref) == 4 and got == ref
    shutil.rmtree(tmp_path, ignore_errors=True)


# ----------------------------------------------------------------------------- leftovers
def test_a_new_store_removes_the_directories_of_dead_processes_only(tmp_path, capsys):
    """A store killed with its process (kill -9) leaves its directory; the next store removes
    it, and keeps those of live processes, of other hosts and of other programs."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = store_lib._host()
    left = tmp_path / f"jaxscale-offload-{host}-{dead.pid}-abc123"
    keep = [tmp_path / f"jaxscale-offload-{host}-{os.getppid()}-live_1",
            tmp_path / f"jaxscale-offload-elsewhere-{dead.pid}-other_1",
            tmp_path / "jaxscale-offload-q8w_z1",             # no process id in its name
            tmp_path / "mine"]
    for d in (left, *keep):
        d.mkdir()
        (d / "0000.bin").write_bytes(b"\0" * 16)
    s = store_lib.Store(str(tmp_path), [store_lib.Leaf((4,), np.dtype("float32"), False)])
    try:
        assert not left.exists() and all(d.exists() for d in keep)
        assert os.path.basename(s.dir).startswith(f"jaxscale-offload-{host}-{os.getpid()}-")
        err = capsys.readouterr().err
        assert str(left) in err and f"process {dead.pid}" in err and "no longer running" in err
    finally:
        s.close()
    assert not os.path.exists(s.dir)


def test_planner_ledger_puts_the_nvme_store_on_disk_and_only_its_pieces_in_host_ram():
    from jaxscale import planner
    from jaxscale.planner.report import format_prediction
    pred = planner.predict(_cfg(*NVME))
    spec, n = pred.spec, pred.spec.n_devices
    assert sum(pred.memory.disk.values()) * n == tiers.store_bytes(spec)
    assert set(pred.memory.disk) == {"optimizer", "master"}
    assert pred.memory.host == {"pieces": tiers.PIECES_IN_FLIGHT * 12 * tiers.piece_elems(spec)
                                / n}
    assert pred.memory.xla["host_argument"] == 0 and pred.memory.optimizer == 0
    text = format_prediction(pred)
    assert "disk optimizer" in text and "disk master" in text and "host pieces" in text
    host = planner.predict(_cfg(*HOST)).memory          # the host update: one copy in RAM
    assert not host.disk and host.host["optimizer"] + host.host["master"] == pytest.approx(
        tiers.store_bytes(spec) / n)
