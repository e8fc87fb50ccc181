"""The Pallas attention tuning table and the backward's tile skipping.

The table: lookups by head-dim bucket, causality and dtype; explicit block sizes, launch settings
or a whole `Tuning` override it, which the Triton lowering for CUDA (no GPU needed) shows in each
kernel's grid, num_warps and num_stages. The backward: both its kernels visit only the tiles the
mask allows, checked on the loop tables they read and by poisoning the tiles they must skip (a
visited, masked tile with an inf in it turns its row's gradient into NaN). The `--tune` sweep
refuses to run off-GPU and smoke-runs with --allow-cpu --tiny. Shapes are tiny (interpret mode).
"""
import functools
import importlib.util
import json
import pathlib
import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.kernels import flash_attention as fa
from jaxscale.kernels import flash_forward
from jaxscale.kernels import flash_tuning as ft
from jaxscale.kernels.tiles import BlockSparseMask, tile_map

ROOT = pathlib.Path(__file__).resolve().parents[1]


def kc(bq, bk, w, s):
    return {"block_q": bq, "block_k": bk, "num_warps": w, "num_stages": s}


def entry(head_dim, causal, dtype, fwd, dq=kc(32, 16, 4, 2), dkdv=kc(16, 32, 4, 2), atomic=False):
    return {"head_dim": head_dim, "causal": causal, "dtype": dtype, "source": "test",
            "fwd": fwd, "dq": dq, "dkdv": dkdv, "dq_atomic": atomic}


TABLE = {"format": 1, "sweeps": [], "entries": [
    entry(32, True, "bfloat16", kc(16, 32, 2, 1)),
    entry(32, False, "bfloat16", kc(32, 16, 4, 2)),
    entry(64, True, "bfloat16", kc(64, 64, 8, 3)),
    entry(32, True, "float32", kc(16, 16, 1, 4)),
]}


def check_entries(table) -> int:
    """Every entry of a tuning table: tiles that fit (powers of two >= 16), launch settings a GPU
    takes, a source that says where it came from; a swept one carries its timings, beside the
    sweep's record. Returns how many were swept."""
    swept = 0
    for e in table["entries"]:
        t = ft.Tuning.from_entry(e)
        t.block_sizes().fit(1 << 16, 1 << 16, None)            # powers of two >= 16
        assert e["source"].startswith(("default", "sweep")), e["source"]
        assert all(getattr(t, k).num_warps in (1, 2, 4, 8, 16) for k in ft.KERNELS)
        if e["source"].startswith("sweep"):
            assert e["timings"]["fwd_ms"] > 0 and e["timings"]["rel_err"] < 2e-2, e
            swept += 1
    assert bool(swept) == bool(table["sweeps"])
    return swept


def test_packaged_table_covers_the_common_shapes_and_says_what_it_is():
    table = ft.load_tuning_table(ft.TUNING_TABLE)
    assert "--tune" in table["about"]
    keys = {(e["head_dim"], e["causal"], e["dtype"]) for e in table["entries"]}
    for hd in (32, 64, 128, 256):
        assert {(hd, False, "bfloat16"), (hd, True, "bfloat16")} <= keys
    check_entries(table)          # swept entries: in test_tune_refuses_off_gpu_and_smoke_runs_tiny


def test_lookup_picks_the_entry_for_head_dim_causality_and_dtype():
    pick = functools.partial(ft.lookup_tuning, table=TABLE)
    assert pick(32, True, jnp.bfloat16).fwd == ft.KernelConfig(16, 32, 2, 1)
    assert pick(32, False, jnp.bfloat16).fwd == ft.KernelConfig(32, 16, 4, 2)
    assert pick(20, True, jnp.bfloat16).fwd.block_k == 32        # bucket: next power of two
    assert pick(64, True, jnp.bfloat16).fwd.block_q == 64
    assert pick(32, True, jnp.float32).fwd.num_stages == 4        # exact dtype first
    t = pick(32, True, jnp.float16)                               # same itemsize as bf16
    assert t.fwd.num_warps == 2 and "nearest" in t.source
    assert pick(128, True, jnp.bfloat16).fwd.block_q == 64        # nearest head dim, same causal
    assert pick(64, False, jnp.bfloat16).fwd.block_q == 32        # causality beats head dim
    assert "built-in fallback" in ft.lookup_tuning(64, True, jnp.bfloat16,
                                                   table={"entries": []}).source


def _triton_launches(monkeypatch, tmp_path, table=TABLE, T=128, D=32, causal=True, **kw):
    """{kernel name: (grid_x, num_warps, num_stages)} of forward+backward lowered for CUDA."""
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv(ft.TUNING_ENV, str(path))

    def loss(q, k, v):
        return fa.flash_attention(q, k, v, causal=causal, interpret=False, **kw).sum()
    args = [jax.ShapeDtypeStruct((1, T, 2, D), jnp.bfloat16)] * 3
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    found = re.findall(r"grid_x = (\d+).*?name = \"flash_attention_(\w+)\", num_stages = (\d+) : "
                       r"i32, num_warps = (\d+)", text)
    assert len(found) == text.count("xla.gpu.triton")
    return {name: (int(g), int(w), int(s)) for g, name, s, w in found}


def test_kernels_launch_with_the_table_entry_unless_told_otherwise(monkeypatch, tmp_path):
    # causal d32 bf16: fwd 16x32 w2 s1, dq 32x16 w4 s2, dk/dv 16x32 w4 s2; T = 128
    assert _triton_launches(monkeypatch, tmp_path) == {
        "fwd": (8, 2, 1), "dq": (4, 4, 2), "dkdv": (4, 4, 2)}
    assert _triton_launches(monkeypatch, tmp_path, causal=False)["fwd"] == (4, 4, 2)
    # explicit block sizes replace the tiles, explicit launch settings replace warps/stages
    got = _triton_launches(monkeypatch, tmp_path, block_sizes=ft.BlockSizes(64, 16, 16, 64, 16, 16),
                           num_warps=8)
    assert got == {"fwd": (2, 8, 1), "dq": (8, 8, 2), "dkdv": (2, 8, 2)}
    # a whole Tuning wins over the table; atomic dQ leaves no dQ kernel
    t = ft.Tuning(ft.KernelConfig(32, 32, 4, 3), ft.KernelConfig(32, 32, 4, 3),
                  ft.KernelConfig(32, 64, 8, 2), dq_atomic=True)
    assert _triton_launches(monkeypatch, tmp_path, tuning=t) == {"fwd": (4, 4, 3),
                                                                 "dkdv": (2, 8, 2)}
    atomic_table = {"entries": [entry(32, True, "bfloat16", kc(16, 32, 2, 1), atomic=True)]}
    assert set(_triton_launches(monkeypatch, tmp_path, table=atomic_table)) == {"fwd", "dkdv"}


def test_missing_table_named_by_the_environment_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv(ft.TUNING_ENV, str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match="nope.json.*JAXSCALE_FLASH_TUNING"):
        ft.lookup_tuning(64, True, jnp.bfloat16)


@pytest.mark.parametrize("T,S,bq,bk,causal,window,q_offset", [
    (128, 128, 32, 32, True, None, 0), (100, 77, 16, 32, True, 20, 5),
    (64, 96, 32, 16, False, 9, 0), (50, 50, 16, 16, False, None, 0),
    (37, 70, 32, 16, True, None, 40)])
def test_loop_tables_visit_exactly_the_mapped_tiles(T, S, bq, bk, causal, window, q_offset):
    """The contiguous (first, first full, end full, end) tables give each row exactly the tiles
    (and full tiles) of the tile map, in both orientations (forward/dQ rows, dK/dV columns)."""
    sch = tile_map(T, S, bq, bk, causal=causal, window=window, q_offset=q_offset)
    for transpose, count, full in ((False, sch.kv_count, sch.kv_full),
                                   (True, sch.q_count, sch.q_full)):
        tables = flash_forward._row_tables(sch, transpose, contiguous=True)
        trips, n_full = flash_forward._trips(tables)
        np.testing.assert_array_equal(trips, count)
        np.testing.assert_array_equal(n_full, full)


def test_backward_kernels_skip_causally_masked_tiles_in_their_loop_tables():
    blocks = ft.BlockSizes(128, 64, 64, 128, 128, 64)
    got = fa.visited_tiles(4096, 4096, causal=True, block_sizes=blocks)
    for kernel in (got, got["dq"], got["dkdv"]):      # forward, dQ, dK/dV
        # forward/dQ: query block i visits key blocks 0..2i+1; dK/dV: key block j visits query
        # blocks 2j..63; 1056 of 2048 tiles either way, of which only the 64 diagonal ones masked
        assert (kernel["dense"], kernel["visited"], kernel["full"]) == (2048, 1056, 992)
    assert got["dkdv"]["programs_per_head"] == 32 and got["dq"]["programs_per_head"] == 32
    window = fa.visited_tiles(4096, 4096, causal=True, window=256, block_sizes=blocks)
    for kernel, (bq, bk) in (("dq", (128, 64)), ("dkdv", (64, 128))):
        sch = tile_map(4096, 4096, bq, bk, causal=True, window=256)
        assert window[kernel]["visited"] == sch.visited < 0.12 * sch.dense
    bm = BlockSparseMask.local(8, 8, width=1, block_q=512, block_k=512)     # index-list tables
    sparse = fa.visited_tiles(4096, 4096, causal=False, block_mask=bm, block_sizes=blocks)
    assert sparse["dkdv"]["visited"] == sparse["dq"]["visited"] == 8 * 4 * 8


@pytest.mark.parametrize("atomic", [False, True], ids=["dq-kernel", "dq-atomic"])
@pytest.mark.parametrize("sparse", [False, True], ids=["causal-ranges", "block-sparse-lists"])
def test_backward_never_touches_a_masked_tile(atomic, sparse):
    """Poison the tiles a causal (or diagonal block-sparse) mask excludes: an inf in the last key
    block's V reaches O and dQ of earlier query rows only if the forward or the dQ pass visits that
    tile (0 * inf = NaN even when masked); an inf in the first query block's Q reaches dK of later
    key blocks only if the dK/dV kernel visits it. GQA group of 2 heads: the group loop too."""
    B, T, H, K, D, blk = 1, 64, 2, 1, 16, 16
    kw = dict(block_sizes=ft.BlockSizes(*[blk] * 6),
              tuning=replace(ft.lookup_tuning(D, True, jnp.float32), dq_atomic=atomic))
    if sparse:
        kw.update(causal=False, block_mask=BlockSparseMask.local(4, 4, 1, blk, blk, causal=True))
    f = functools.partial(fa.flash_attention, **kw)
    step = jax.jit(lambda q, k, v, do: (f(q, k, v), *jax.vjp(f, q, k, v)[1](do)))
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, T, n, D)) for kk, n in zip(ks, (H, K, K, H)))

    o, dq, dk, dv = step(q, k, v.at[:, T - blk:].set(jnp.inf), do)
    assert np.isfinite(o[:, :T - blk]).all() and np.isfinite(dq[:, :T - blk]).all()
    assert not np.isfinite(o[:, T - blk:]).all()          # the poison is live where it may be
    o, dq, dk, dv = step(q.at[:, :blk].set(jnp.inf), k, v, do)
    assert np.isfinite(dk[:, blk:]).all() and np.isfinite(dv[:, blk:]).all()
    assert not np.isfinite(dk[:, :blk]).all()


def _bench():
    spec = importlib.util.spec_from_file_location(
        "gpu_flash_bench", ROOT / "experiments" / "gpu_flash_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_tune_refuses_off_gpu_and_smoke_runs_tiny(tmp_path):
    bench = _bench()
    packaged = ft.TUNING_TABLE.read_text()
    with pytest.raises(SystemExit, match="not an NVIDIA GPU.*--allow-cpu --tiny"):
        bench.main(["--tune", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="not an NVIDIA GPU"):
        bench.main(["--tune", "--allow-cpu", "--out", str(tmp_path)])     # --tiny is needed too
    with pytest.raises(SystemExit, match="never writes the packaged table"):
        bench.main(["--tune", "--allow-cpu", "--tiny", "--table", str(ft.TUNING_TABLE)])
    table_path = tmp_path / "t.json"
    bench.main(["--tune", "--allow-cpu", "--tiny", "--out", str(tmp_path / "out"),
                "--table", str(table_path)])
    assert ft.TUNING_TABLE.read_text() == packaged
    table = ft.load_tuning_table(table_path)
    assert table["sweeps"][-1]["device_kind"] and table["sweeps"][-1]["date"]
    assert check_entries(table) == 1
    swept = [e for e in table["entries"] if e["source"].startswith("sweep")]
    assert [(e["head_dim"], e["causal"], e["dtype"]) for e in swept] == [(32, True, "bfloat16")]
    assert len(table["entries"]) == len(json.loads(packaged)["entries"])   # others kept
    t = ft.lookup_tuning(32, True, jnp.bfloat16, table=table)
    assert t.source.startswith("table d32 causal=True bfloat16: sweep")
    assert "| 32 | True |" in (tmp_path / "out" / "tune.md").read_text()
    assert json.loads((tmp_path / "out" / "flash_tuning.json").read_text()) == table


def test_compile_report_says_what_it_needs(monkeypatch, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, "triton", None)       # as on a machine without triton
    with pytest.raises(SystemExit, match="needs the triton package"):
        _bench().main(["--compile-report", "--out", str(tmp_path)])
