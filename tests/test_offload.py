"""Host offload (`plan.offload`): the update streamed through the device one layer at a time.

What is checked, on the tiny model (2 layers) and the 8 simulated CPU devices:
- numerics: the streamed step gives the non-offloaded step's new state (to fp32 rounding: XLA:CPU
  fuses the same element-wise update differently inside the loop), the same losses, the same
  skip of a non-finite step and the same loss-scale halving; ZeRO's layer-split state too;
- the GPU program (lowered for CUDA here, not compiled): every host->device transfer of offloaded
  state is one layer's slice inside the layer loop (or an unstacked leaf), never a whole stacked
  leaf, and every layer goes back to host memory inside the loop;
- the CPU program (compiled): the loop runs once per layer, updates the offloaded buffers in place
  (no whole copy of them), and its temp is below the non-offloaded step's;
- the planner's memory prediction against the compiled program, and its GPU criterion;
- no collective added; a checkpoint of the host-resident state restores into host memory and
  resumes exactly.
"""
import functools
import re
from collections import Counter

import jax
import numpy as np

from jaxscale import planner
from jaxscale.analysis import hlo, inspect, validation
from jaxscale.data import Batches, load_corpus
from jaxscale.plan import Spec
from jaxscale.strategies import offload
from jaxscale.strategies.offload import streaming
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train.setup import build
from tests.helpers import tiny_config

BASE = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", "plan.precision=bf16", "plan.loss_scale=dynamic")
OFF = (*BASE, "plan.offload=optimizer+master")
ZERO = ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4", "plan.precision=bf16", "plan.zero=1")
LAYERS = 2


@functools.lru_cache(maxsize=None)
def _batches():
    return Batches(load_corpus(tiny_config().data).train, 8, 32, seed=0)


@functools.lru_cache(maxsize=None)
def _compiled(*overrides):
    setup = build(tiny_config(*overrides))
    exe = setup.lower_train_step().compile()
    return setup, exe, exe.as_text()


def _batch(setup, i, poison=False):
    b = _batches().global_rows(i)
    if poison:
        b = {**b, "mask": b["mask"] * np.float32(np.nan)}
    return {k: jax.device_put(v, setup.batch_shardings()[k]) for k, v in b.items()}


@functools.lru_cache(maxsize=None)
def _run(overrides, steps, poison=None):
    """States after each step (as numpy) and the metrics, with the compiled step."""
    setup, exe, _ = _compiled(*overrides)
    state, states, rows = setup.init_state(), [], []
    for i in range(steps):
        state, m = exe(state, _batch(setup, i, poison=i == poison))
        states.append(jax.tree.map(lambda x: np.asarray(x.astype(np.float32)), state))
        rows.append({k: float(v) for k, v in m.items()})
    return states, rows, state


def _assert_same_state(ref, got):
    """fp32 parts to 1e-6 of each leaf's scale; 16-bit parameters to one bf16 step (they are
    the master weights rounded, and the master weights may differ in the last fp32 bit)."""
    for part in ("opt_state", "master", "loss_scale"):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(getattr(ref, part)),
                                jax.tree.leaves(getattr(got, part))):
            scale = max(float(np.max(np.abs(a))), 1e-30)
            err = float(np.max(np.abs(a - b))) if a.size else 0.0
            assert err <= 1e-6 * scale, (part, jax.tree_util.keystr(path), err, scale)
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.params)):
        np.testing.assert_allclose(b, a, rtol=2 ** -7, atol=0)
        assert np.mean(a != b) < 1e-3
    assert int(np.asarray(ref.step)) == int(np.asarray(got.step))


# ----------------------------------------------------------------------------- numerics
def test_streamed_step_equals_the_whole_update_and_skips_alike():
    steps, poison = 3, 1
    ref_states, ref_rows, _ = _run(BASE, steps, poison)
    states, rows, live = _run(OFF, steps, poison)
    assert [r["skipped"] for r in rows] == [r["skipped"] for r in ref_rows] == [0, 1, 0]
    assert [r["loss_scale"] for r in rows] == [r["loss_scale"] for r in ref_rows]
    assert rows[2]["loss_scale"] == rows[1]["loss_scale"] / 2          # halved by the skip
    # two compiled programs, so nothing bitwise but counts: the learning rate is the same
    # schedule (to one rounding of its cosine); the first step's loss and norm come from the
    # same parameters and batch (to 4 fp32 ulps: their sums fused otherwise), later ones from
    # states equal to fp32 rounding (below)
    for key, first, rest in (("tokens", 0, 0), ("lr", 2 ** -23, 2 ** -23),
                             ("loss", 2 ** -21, 1e-6), ("grad_norm", 2 ** -21, 1e-6)):
        got, ref = [r[key] for r in rows], [r[key] for r in ref_rows]
        np.testing.assert_allclose(got[:1], ref[:1], rtol=first, atol=0, err_msg=key)
        np.testing.assert_allclose(got, ref, rtol=rest, atol=0, equal_nan=True, err_msg=key)
    # the skipped step left parameters, master weights and moments exactly as they were
    for part in ("params", "opt_state", "master"):
        for a, b in zip(jax.tree.leaves(getattr(states[0], part)),
                        jax.tree.leaves(getattr(states[1], part))):
            np.testing.assert_array_equal(a, b)
    for ref, got in zip(ref_states, states):
        _assert_same_state(ref, got)
    kinds = Counter(x.sharding.memory_kind for x in jax.tree.leaves((live.opt_state, live.master)))
    assert kinds["pinned_host"] == 3 * 12 and kinds["device"] == 2      # moments, master; counts


def test_zero_split_layers_stream_one_layer_per_device():
    """ZeRO-1 over dp=2 splits the 2 stacked layers between the dp devices: the loop then takes
    one layer from each device's own block per iteration (1 iteration of 2 layers here)."""
    setup, _, _ = _compiled(*ZERO, "plan.offload=optimizer+master")
    master = jax.tree.leaves(setup.state_shardings.master["layers"])
    assert streaming.pieces(LAYERS, master) == (1, 2)
    ref, ref_rows, _ = _run(ZERO, 2)
    got, rows, _ = _run((*ZERO, "plan.offload=optimizer+master"), 2)
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref_rows], rtol=1e-6)
    for a, b in zip(ref, got):
        _assert_same_state(a, b)


# ----------------------------------------------------------------------------- programs
def _offloaded_stacked_shapes(setup) -> Counter:
    """Shapes (HLO spelling, per device) of the layer-stacked leaves living in host memory."""
    out = Counter()
    for leaf in jax.tree.leaves(setup.abstract_state()):
        if leaf.sharding.memory_kind == "pinned_host" and leaf.ndim and leaf.shape[0] == LAYERS:
            dims = ",".join(map(str, leaf.sharding.shard_shape(leaf.shape)))
            out[f"{np.dtype(leaf.dtype).name.replace('float', 'f')}[{dims}]"] += 1
    return out


def _callees(module_text: str) -> dict[str, set[str]]:
    calls: dict[str, set[str]] = {}
    comp = None
    for line in module_text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and "=" not in line.split("(")[0]:
            comp = m.group(1)
            continue
        if comp:
            calls.setdefault(comp, set()).update(
                re.findall(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line))
    return calls


def _reachable(calls, roots) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo += calls.get(c, ())
    return seen


def test_gpu_program_moves_one_layer_at_a_time():
    """Lowered for CUDA (no GPU needed: lowering only), the program's memory-space annotations
    (`annotate_device_placement`, which XLA:GPU's host offloader turns into copies) show where
    the offloaded state moves. XLA:CPU lowers them to nothing, hence the CUDA lowering."""
    setup = build(tiny_config(*OFF))
    with jax.set_mesh(setup.placement.mesh):
        text = setup.train_step.trace(setup.abstract_state(), setup.abstract_batch()).lower(
            lowering_platforms=("cuda",)).as_text(dialect="hlo")
    mod = hlo.Module(text)
    calls = _callees(text)
    in_loop = _reachable(calls, [b for i in mod.instrs if i.opcode == "while"
                                 for b in re.findall(r"\bbody=%?([\w.\-]+)", i.rest)])
    moves = Counter()
    for ins in mod.instrs:
        if ins.opcode == "custom-call" and "annotate_device_placement" in ins.rest:
            kind = re.search(r'_xla_buffer_placement="(\w+)"', ins.rest).group(1)
            shape = ins.type_str.split("{")[0]
            moves[(ins.computation in in_loop, kind, shape)] += 1
    stacked = _offloaded_stacked_shapes(setup)
    layer = Counter({re.sub(r"\[\d+,", "[", s): n for s, n in stacked.items()})
    assert sum(stacked.values()) == 3 * 9          # moments and master of 9 stacked leaves
    # inside the loop: one layer of every offloaded stacked leaf in, and back out
    assert Counter({s: n for (loop, k, s), n in moves.items() if loop and k == "device"}) == layer
    assert Counter({s: n for (loop, k, s), n in moves.items() if loop and k == "pinned_host"}) \
        == layer
    # outside it: the first layer's fetch; no whole stacked leaf ever goes to the device
    outside = Counter({s: n for (loop, k, s), n in moves.items() if not loop and k == "device"})
    for shape, n in layer.items():
        assert outside[shape] >= n
    assert not set(stacked) & set(outside)


def test_cpu_program_updates_in_place_layer_by_layer():
    setup, exe, text = _compiled(*OFF)
    mod = hlo.Module(text)
    stacked = set(_offloaded_stacked_shapes(setup))
    # the entry parameters in host memory (S(5)) that are layer-stacked state
    layout = re.sub(r"/\*.*?\*/", "", re.search(r"entry_computation_layout=\{\((.*?)\)->",
                                                  text).group(1))
    host = {i for i, p in enumerate(hlo._split_top(layout))
            if "S(5)" in p and p.split("{")[0] in stacked}
    assert len(host) == 3 * 9                      # moments and master of 9 stacked leaves
    names = {int(re.match(r"\s*(\d+)", i.rest).group(1)): i.name for i in mod.instrs
             if i.computation == mod.entry and i.opcode == "parameter"}
    host_names = {names[i] for i in host}

    def operands(ins):
        return {re.sub(r"/\*.*?\*/", "", o).strip().lstrip("%")
                for o in hlo._split_top(hlo._operand_text(ins.rest))}
    # the update loop starts from those very buffers (updated in place, no copy first) ...
    loops = [w for w in mod.instrs if w.computation == mod.entry and w.opcode == "while"
             and host_names <= operands(mod.defs[(mod.entry, operands(w).pop())])]
    assert len(loops) == 1
    loop = loops[0]
    assert re.search(r'"known_trip_count":\{"n":"%d"' % LAYERS, loop.rest)   # once per layer
    assert not [i for i in mod.instrs if i.computation == mod.entry and i.opcode == "copy"
                and operands(i) & host_names]
    # ... and copies no whole stacked buffer inside (only one layer's slices)
    body = re.search(r"\bbody=%?([\w.\-]+)", loop.rest).group(1)
    inside = _reachable(_callees(text), [body])
    copies = [i.type_str.split("{")[0] for i in mod.instrs
              if i.computation in inside and i.opcode == "copy"]
    assert copies and not set(copies) & stacked
    # and holds at most one streamed piece more than the non-offloaded step's in-place update
    _, base_exe, _ = _compiled(*BASE)
    piece = offload.piece_bytes(Spec.from_config(setup.cfg))
    assert piece > 0
    assert inspect.memory(exe)["temp"] <= inspect.memory(base_exe)["temp"] + piece


def test_offload_adds_no_collective():
    setup, exe, text = _compiled(*OFF)
    _, _, base_text = _compiled(*BASE)
    mesh = setup.placement.mesh
    assert inspect.census(text, mesh) == inspect.census(base_text, mesh)


# ----------------------------------------------------------------------------- planner
def test_planner_predicts_the_streamed_update():
    setup, exe, text = _compiled(*OFF)
    cfg = setup.cfg
    rep = {"memory": inspect.memory(exe), "collectives": inspect.census(text,
                                                                          setup.placement.mesh),
           "flops": inspect.flops(exe, text)}
    cmp = validation.compare(planner.predict(cfg), rep, backend="cpu")
    assert cmp["ok"], validation.format_comparison(cmp)
    # the update phase, by hand: the fp32 gradient stack (4 Psi: XLA:CPU widens 16-bit
    # gradients), and with offload one streamed layer on top: its bf16 parameters, fp32 master,
    # two fp32 moments and fp32 gradient, 2 + 4 + 8 + 4 = 18 bytes a parameter (XLA:CPU has one
    # memory, so no second copy of the host-homed parts)
    m = cfg.model
    assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.hd, m.ffn_dim) == \
        (320, 128, LAYERS, 8, 4, 16, 384)
    layer = 128 * (8 + 2 * 4) * 16 + 8 * 16 * 128 + 3 * 128 * 384 + 2 * 128
    psi = 2 * 320 * 128 + LAYERS * layer + 128
    mem, base = planner.predict(cfg).memory, planner.predict(tiny_config(*BASE)).memory
    assert [t.bytes for t in mem.terms if "streamed piece" in t.what] == [18 * layer]
    assert base.phases["update"] == 4 * psi
    assert mem.phases["update"] == 4 * psi + 18 * layer


def test_planner_gpu_device_total_falls_by_the_offloaded_bytes():
    """The issue's H200 model (0.57B, bf16, one device), by hand: Psi = 2 V D + L (D (H + 2 K) hd
    + H hd D + 3 D F + 2 D) + D parameters; offloading the optimizer and master moves their
    12 Psi bytes (fp32 master, two fp32 moments) to the host, and the device total falls by
    exactly that: the backward (activations) stays the larger phase, unchanged, while the update
    grows by one streamed layer: its bf16 parameters and fp32 gradient (2 + 4 bytes a parameter)
    and, on a GPU, the host-homed parts twice (the new values wait for their copy back):
    2 x (4 + 8), 30 bytes a parameter of one layer."""
    model = ("model.dim=2048", "model.n_layers=12", "model.n_heads=16", "model.n_kv_heads=8",
             "model.ffn_dim=5632", "model.max_seq_len=2048", "data.seq_len=2048",
             "data.batch_size=8", "plan.precision=bf16", "mesh=h200x1")
    from jaxscale.config import apply_overrides, load_experiment
    none = planner.predict(apply_overrides(load_experiment("llama_tiny"), list(model)), 1)
    off = planner.predict(apply_overrides(load_experiment("llama_tiny"),
                                          [*model, "plan.offload=optimizer+master"]), 1)
    m = off.spec.model
    V, D, L, H, K, hd, F = 320, 2048, 12, 16, 8, 128, 5632
    assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.hd, m.ffn_dim) == \
        (V, D, L, H, K, hd, F)
    layer = D * (H + 2 * K) * hd + H * hd * D + 3 * D * F + 2 * D
    psi = 2 * V * D + L * layer + D
    assert psi == 567_592_960
    assert off.memory.host == {"master": 4 * psi, "optimizer": 8 * psi}
    assert off.memory.xla["host_argument"] == 12 * psi and none.memory.xla["host_argument"] == 0
    assert none.memory.xla["total"] - off.memory.xla["total"] == 12 * psi
    assert off.memory.phases["backward"] == none.memory.phases["backward"]
    assert none.memory.phases["update"] == 2 * psi                 # the bf16 gradient stack
    assert off.memory.phases["update"] == 2 * psi + layer * (2 + 4 + 2 * (4 + 8))


# ----------------------------------------------------------------------------- checkpoint
def test_checkpoint_of_host_state_restores_into_host_memory_and_resumes(tmp_path):
    setup, exe, _ = _compiled(*OFF)
    state = setup.init_state()
    state, _ = exe(state, _batch(setup, 0))
    ck = ckpt_lib.Checkpointer(tmp_path / "ck", setup.cfg.ckpt)
    ck.save(1, state, ckpt_meta.make_meta(setup.cfg, state, 1))
    ck.wait()
    ck.close()
    ck = ckpt_lib.Checkpointer(tmp_path / "ck", setup.cfg.ckpt, read_only=True)
    meta = ck.read_meta(1)
    assert not ckpt_meta.check_compatible(meta, setup.cfg, setup.abstract_state(), "ck")
    restored = ck.restore(1, setup.abstract_state(), meta["checksums"])
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.sharding.memory_kind == b.sharding.memory_kind
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    host = [x for x in jax.tree.leaves(restored.opt_state) if x.ndim]
    assert host and all(x.sharding.memory_kind == "pinned_host" for x in host)
    batch = _batch(setup, 1)
    live, m1 = exe(state, batch)
    again, m2 = exe(restored, batch)
    assert {k: float(v) for k, v in m1.items()} == {k: float(v) for k, v in m2.items()}
    for a, b in zip(jax.tree.leaves(live), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
