"""The nvme tier's host RAM, counted where it is held: the offloaded state is in files (their
bytes the store's formula), the train state between steps holds none of it, and during a step
the store hands out at most a few pieces at once (the planner's `host pieces` bound), where the
host tier holds the whole of it in pinned host memory. The process's RSS, which depends on the
allocator and on whatever else the process holds, is measured by `benchmarks/offload_rss.py`."""
import os
import threading

import jax
import numpy as np
import pytest

from jaxscale.data import Batches, load_corpus
from jaxscale.strategies.offload import store as store_lib
from jaxscale.strategies.offload import tiers
from jaxscale.train.setup import build
from tests.helpers import tiny_config

#: one device; 8 layers, so that a piece (one layer of every stacked leaf) is a small part of
#: the store
OV = ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1", "plan.precision=bf16",
      "plan.offload=optimizer+master", "model.n_layers=8", "data.seq_len=16")


def _steps(setup, n):
    rows = Batches(load_corpus(setup.cfg.data).train, 8, 16, seed=0)
    state = setup.init_state()
    for i in range(n):
        batch = {k: jax.device_put(v, setup.batch_shardings()[k])
                 for k, v in rows.global_rows(i).items()}
        state, m = setup.train_step(state, batch)
        assert np.isfinite(float(m["loss"]))
        yield state


@pytest.fixture
def held(monkeypatch):
    """The bytes the store has handed out (read) and not yet taken back (written): its pieces
    in host RAM; the most at once, since `held.reset()`."""
    read, write = store_lib.Store.read, store_lib.Store.write
    lock = threading.Lock()
    count = {"now": 0, "most": 0}

    def counting_read(self, k, layer=None):
        out = read(self, k, layer)
        with lock:
            count["now"] += out.nbytes
            count["most"] = max(count["most"], count["now"])
        return out

    def counting_write(self, k, value, layer=None):
        write(self, k, value, layer)
        with lock:
            count["now"] -= int(np.prod(self.leaves[k].window(layer)[1])) * \
                np.dtype(self.leaves[k].dtype).itemsize

    def reset():
        count.update(now=0, most=0)
    monkeypatch.setattr(store_lib.Store, "read", counting_read)
    monkeypatch.setattr(store_lib.Store, "write", counting_write)
    count["reset"] = reset
    return count


def test_nvme_keeps_the_offloaded_state_in_files_and_a_few_pieces_in_ram(tmp_path, held):
    cfg = tiny_config(*OV, "plan.offload_tier=nvme", f"plan.offload_dir={tmp_path}")
    setup = build(cfg, jax.devices()[:1])
    spec = setup.placement.spec
    store_bytes, pieces = tiers.store_bytes(spec), tiers.host_ram_bytes(spec)["pieces"]
    steps = _steps(setup, 2)
    state = next(steps)                             # compiled, the store written
    held["reset"]()
    state = next(steps)
    (directory,) = [d for d in os.listdir(tmp_path) if d.startswith(store_lib.PREFIX)]
    files = [os.path.join(tmp_path, directory, f) for f in os.listdir(tmp_path / directory)]
    assert sum(os.path.getsize(f) for f in files) == store_bytes     # on disk, whole
    assert state.opt_state is None and state.master is None          # not in the state
    assert held["now"] == 0                          # every piece read was written back
    per_piece = (store_bytes - 4 * tiers.counters(spec)) / tiers.psi(spec) * \
        tiers.piece_elems(spec)
    # in RAM at once, besides the 4-byte step counters: the piece in hand and the one read
    # ahead or the one being written back (at most all three), within the planner's bound of
    # PIECES_IN_FLIGHT pieces, which is under half the store here
    counters = 4 * tiers.counters(spec)
    assert 2 * per_piece <= held["most"] - counters <= 3 * per_piece <= pieces < store_bytes / 2


def test_the_host_tier_holds_the_whole_store_in_pinned_host_memory():
    """The comparison: the host tier keeps the same bytes as arrays in pinned host memory."""
    setup = build(tiny_config(*OV), jax.devices()[:1])
    state = next(_steps(setup, 1))
    held = [x for x in jax.tree.leaves((state.opt_state, state.master))]
    assert {x.sharding.memory_kind for x in held if x.ndim} == {"pinned_host"}
    assert sum(x.nbytes for x in held) == tiers.store_bytes(setup.placement.spec)
