"""The offload tiers (`plan.offload_tier=nvme`, `plan.offload_update=host`, `plan.offload_delay`).

On the tiny model (2 layers) and the 8 simulated CPU devices:
- nvme: three steps give the host tier's losses, working parameters, moments and fp32 master
  to one rounding at the leaf's scale (two compiled programs: XLA:CPU compiles the last
  multiply-add of the update differently inside the host tier's layer loop than in the
  per-piece program); the bytes read from and written to disk, and over the host link, equal
  `tiers`' formulas; a run killed (SIGKILL) in the middle of a step's update resumes from its
  Orbax checkpoint to the uninterrupted run's losses;
- host update: three real updates (full learning rate from the first) are the device update's
  to fp32 rounding; the delayed update applies the gradient of step s taken at the parameters
  after s - 1 updates, against optax's AdamW applied by hand to the device step's gradients;
  the state a checkpoint saves does not change with later steps;
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


Run = namedtuple("Run", "losses states counted setup initial")


def _host(state):
    return jax.tree.map(lambda x: np.array(x.astype(np.float32)), state)


@functools.lru_cache(maxsize=None)
def _run(ov, steps):
    setup = build(_cfg(*ov))
    state, losses, states, counted = setup.init_state(), [], [], []
    initial = _host(setup.full_state(state))
    for i in range(steps):
        if hasattr(setup.train_step, "reset_counts"):
            setup.train_step.reset_counts()
        state, m = setup.train_step(state, _batch(setup, i))
        losses.append(float(m["loss"]))
        if hasattr(setup.train_step, "counted"):
            counted.append(setup.train_step.counted())
        states.append(_host(setup.full_state(state)))
    return Run(losses, states, counted, setup, initial)


def _ulps(a, b, part, n=1):
    """Every leaf of `part` within n roundings at the leaf's scale (fp32: 2^-23 of its largest
    value): what two compiled programs of the same arithmetic may differ by."""
    for x, y in zip(jax.tree.leaves(getattr(a, part)), jax.tree.leaves(getattr(b, part))):
        assert np.max(np.abs(x - y)) <= n * 2 ** -23 * np.max(np.abs(x)), part
    return True


def _params_follow_master(a, b):
    """The 16-bit parameters are the master's cast: they differ only where the master took its
    last add's other rounding, and then by one bf16 ulp of the element plus the masters'
    difference."""
    leaves = lambda s, part: jax.tree.leaves(getattr(s, part))
    for x, y, u, v in zip(leaves(a, "params"), leaves(b, "params"), leaves(a, "master"),
                          leaves(b, "master")):
        d = x != y
        assert not np.any(d & (u == v)), "parameters differ where the master does not"
        bound = 2 ** -7 * np.abs(x) + np.abs(u - v)
        assert np.all(np.abs(x - y)[d] <= bound[d]), "more than the master's cast"
    return True


def _moved(run: Run) -> float:
    """The mean |master_1 - master_0| of the first update, in learning rates (AdamW's first
    step moves each element whose gradient is not zero by about lr)."""
    lr = run.setup.cfg.optim.lr
    d = [np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(run.states[0].master),
                                               jax.tree.leaves(run.initial.master))]
    return float(np.concatenate(d).mean() / lr)


def _assert_same_steps(ref: Run, got: Run):
    """Two programs of the same updates. The weights moved (a real update at full lr, the bias
    corrections at their largest); the first update's state to one rounding at each leaf's
    scale (XLA may contract the update's last multiply-add in one program and not in the
    other). From then on the working parameters, bf16 casts of masters one rounding apart,
    differ by a bf16 ulp here and there, so later steps take the numerics harness's bf16 rule
    (`tests/numerics.py`): the mean master difference within 2e-2 lr (measured 2.4e-4 lr after 3
    updates; a wrong update moves every weight by about 1 lr), the losses within 1e-5
    (measured 3.3e-6)."""
    assert _moved(ref) > 0.25 and _moved(got) > 0.25, (_moved(ref), _moved(got))
    a, b = ref.states[0], got.states[0]
    assert _ulps(a, b, "opt_state") and _ulps(a, b, "master") and _params_follow_master(a, b)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    lr = ref.setup.cfg.optim.lr
    for a, b in zip(ref.states[1:], got.states[1:]):
        d = np.concatenate([np.abs(x - y).ravel() for x, y in
                            zip(jax.tree.leaves(a.master), jax.tree.leaves(b.master))])
        assert d.mean() <= 2e-2 * lr, d.mean() / lr


# ----------------------------------------------------------------------------- nvme
def test_nvme_steps_are_the_host_tier_steps_and_move_the_formula_bytes():
    ref, got = _run((), 3), _run(NVME, 3)
    _assert_same_steps(ref, got)
    spec = got.setup.placement.spec
    disk, link = tiers.disk_bytes(spec), tiers.host_link_bytes(spec)
    assert disk["read"] == tiers.store_bytes(spec) > 12 * tiers.psi(spec)
    for c in got.counted:
        assert (c["disk_read"], c["disk_written"]) == (disk["read"], disk["written"])
        assert (c["link_in"], c["link_out"]) == (link["in"], link["out"])
    # the store is a working store: its files live under plan.offload_dir while the run lives
    assert any(n.startswith("jaxscale-offload-") for n in os.listdir(_nvme_dir()))


def test_host_update_steps_are_the_device_updates():
    """Three real AdamW updates (full lr from the first: the bias corrections at their largest)
    on the host in numpy against XLA's optax on the device."""
    ref, got = _run((), 3), _run(HOST, 3)
    _assert_same_steps(ref, got)
    link = tiers.host_link_bytes(got.setup.placement.spec)
    assert (got.counted[0]["link_in"], got.counted[0]["link_out"]) == (link["in"], link["out"])
    assert got.counted[0]["disk_read"] == 0


def test_host_update_steps_a_routing_bias_by_its_sign_rule():
    """A mixture's routing biases take DeepSeek-V3's -rate x sign step on the host too: the
    first step equals the device update's, biases included."""
    moe = ("model.moe_experts=4", "model.moe_bias_rate=0.01", "model.moe_dropless=true")
    ref, got = _run(moe, 1), _run((*moe, *HOST), 1)
    _assert_same_steps(ref, got)
    bias = got.states[0].master["layers"]["mlp"]["router_bias"]
    assert np.abs(bias).max() > 0


def test_delayed_update_reads_parameters_one_step_stale():
    """DPU: step 1's gradient is taken at the initial parameters (step 0's update still runs),
    then applied after step 0's. The reference is independent of the host update: the device
    step's mean gradients of batches 0 and 1, both at the initial weights, and optax's AdamW
    (`make_optimizer`, the device update's) applied to them by hand, in order."""
    from jaxscale.train.state import make_optimizer
    cfg = _cfg(*HOST, "plan.offload_delay=true")
    setup = build(cfg)
    state = setup.init_state()
    p0 = _host(setup.full_state(state).master)
    state, m0 = setup.train_step(state, _batch(setup, 0))
    state, m1 = setup.train_step(state, _batch(setup, 1))
    got = _host(setup.full_state(state).master)
    dev = build(_cfg(), donate=False, with_grads=True)
    s0 = dev.init_state()
    (_, r0), (_, r1) = (dev.train_step(s0, _batch(dev, i)) for i in (0, 1))
    assert (float(m0["loss"]), float(m1["loss"])) == (float(r0["loss"]), float(r1["loss"]))
    assert float(m1["loss"]) != _run(HOST, 2).losses[1]       # not the undelayed one
    opt, _ = make_optimizer(cfg.optim, cfg.train.steps)
    want, opt_state = p0, opt.init(p0)
    for r in (r0, r1):
        update, opt_state = opt.update(_host(r["grads"]), opt_state, want)
        want = jax.tree.map(lambda p, u: p + u, want, update)
    lr = cfg.optim.lr
    moved = np.concatenate([np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(got),
                                                                  jax.tree.leaves(p0))])
    assert moved.mean() > 0.5 * lr                  # two real updates
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        # numpy's fp32 against XLA's (which may contract a multiply-add): 1e-2 lr at most
        assert np.max(np.abs(a - b)) <= 1e-2 * lr, jax.tree_util.keystr(path)


def test_the_state_a_checkpoint_saves_does_not_change_with_later_steps():
    """The host tier's RAM store updates its arrays in place: the whole state read for a
    checkpoint (`full_state`) is a copy, not a view that the next step's update rewrites."""
    setup = build(_cfg(*HOST))
    state = setup.init_state()
    state, _ = setup.train_step(state, _batch(setup, 0))
    saved = setup.full_state(state)
    before = _host(saved)
    state, _ = setup.train_step(state, _batch(setup, 1))
    after = _host(setup.full_state(state))
    for a, b, c in zip(jax.tree.leaves(before.master), jax.tree.leaves(_host(saved).master),
                       jax.tree.leaves(after.master)):
        np.testing.assert_array_equal(a, b)             # what was read stays what was read
    assert any(np.any(a != c) for a, c in zip(jax.tree.leaves(before.master),
                                              jax.tree.leaves(after.master)))


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
