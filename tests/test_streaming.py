"""Token shards and the streamed, packed pipeline: formats (text, jsonl, parquet), every document
once per epoch, processes splitting rows, exact O(1) resume under any process count, packed
losses equal to one-by-one losses, flat memory on a corpus larger than a memory cap, and clear
errors before training."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jaxscale.config import Config, DataConfig, data_problems
from jaxscale.data import make_batches, shards, tokenizer
from jaxscale.data.stream import PACK_BINS, PackedBatches, Stream

ROOT = Path(__file__).resolve().parent.parent
WORDS = "alpha beta gamma délta ε ζήτα 日本語 código naïve jax 🙂 loss step".split()


def _docs(n: int, seed: int = 0, lo: int = 2, hi: int = 30) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc{i:04d} " + " ".join(rng.choice(WORDS, rng.integers(lo, hi))) for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents in three formats: 60 jsonl lines, 40 parquet rows, 3 text files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    d = tmp_path_factory.mktemp("corpus")
    docs = _docs(103)
    (d / "a.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                                       for i, t in enumerate(docs[:60])))
    pq.write_table(pa.table({"text": docs[60:100], "n": list(range(40))}), d / "b.parquet",
                   row_group_size=16)
    for i, t in enumerate(docs[100:]):
        (d / f"c{i}.txt").write_text(t)
    return d, docs


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    d, docs = corpus
    out = tmp_path_factory.mktemp("shards")
    files = sorted(d.iterdir())
    shards.prepare(files, tokenizer.ByteTokenizer(), out, heldout_fraction=0.1,
                   shard_tokens=1500, source=str(d / "*"))
    return out, docs


def _all_docs(out, split="train", tok=None) -> list[str]:
    src = shards.TokenShards(out, split)
    tok = tok or tokenizer.ByteTokenizer()
    return [tok.decode(src[i][1:-1]) for i in range(len(src))]


def test_prepare_reads_every_format_and_round_trips(prepared, corpus, tmp_path):
    out, docs = prepared
    m = shards.read_manifest(out)
    assert m["splits"]["train"]["docs"] + m["splits"]["heldout"]["docs"] == len(docs)
    assert len(m["splits"]["train"]["shards"]) > 1 and m["dtype"] == "<u2"
    assert 0 < m["splits"]["heldout"]["docs"] < 30
    assert sorted(_all_docs(out) + _all_docs(out, "heldout")) == sorted(docs)
    # through a trained BPE as well (non-ASCII text survives the shards)
    bpe = tokenizer.train_bpe(docs, 300, tmp_path / "tok")
    shards.prepare(sorted(corpus[0].iterdir()), bpe, tmp_path / "s")
    assert sorted(_all_docs(tmp_path / "s", tok=bpe) + _all_docs(tmp_path / "s", "heldout",
                                                                  tok=bpe)) == sorted(docs)


class _Doc:
    """A source of one document: what `Stream` reads of `TokenShards`."""

    def __init__(self, doc):
        self.doc = doc

    def __len__(self):
        return 1

    def length(self, i):
        return len(self.doc)

    def read(self, i, start=0, stop=None):
        return self.doc[start:stop]


def test_pieces_cover_a_long_document():
    doc = np.arange(23)
    st = Stream(_Doc(doc), 8, seed=0, epochs=1)
    rows = [row for row, _ in st.rows()]
    assert [[n for _, _, n in r] for r in rows] == [[8], [8], [6]]     # one piece per row
    got = [st.read(r) for r in rows]
    assert np.array_equal(np.concatenate([g["inputs"][g["mask"] > 0] for g in got]), doc[:-1])
    assert np.array_equal(np.concatenate([g["targets"][g["mask"] > 0] for g in got]), doc[1:])


def _pieces(src, seed, epochs=1, seq_len=48) -> list[tuple]:
    return [(d, lo) for row, _ in Stream(src, seq_len, seed, epochs).rows() for d, lo, _ in row]


def _every_piece(src, seq_len=48) -> list[tuple]:
    return sorted((i, k * seq_len) for i in range(len(src))
                  for k in range(-(-(src.length(i) - 1) // seq_len)))


def test_every_piece_once_per_epoch_and_processes_split_rows(prepared):
    out, _ = prepared
    src = shards.TokenShards(out, "train")
    one = _pieces(src, seed=5)
    assert sorted(one) == _every_piece(src)                 # each exactly once, none lost
    assert sorted(_pieces(src, seed=5, epochs=2)) == sorted(one * 2)
    order = Stream(src, 48, seed=5).order
    n = len(src)
    assert [order[g] for g in range(n)] != [order[g] for g in range(n, 2 * n)]   # a new order
    assert [d for d, _ in _pieces(src, seed=6)] != [d for d, _ in one]  # another seed
    # processes keep consecutive rows of one global batch, and read only those
    ref = PackedBatches(out, "train", 8, 48, seed=3, process_index=0, process_count=1)
    whole = [ref.local_rows(i) for i in range(5)]
    for n in (2, 4):
        parts = [PackedBatches(out, "train", 8, 48, seed=3, process_index=p, process_count=n)
                 for p in range(n)]
        for i in range(5):
            got = [b.local_rows(i) for b in parts]
            for k in whole[i]:
                assert np.array_equal(np.concatenate([g[k] for g in got]), whole[i][k])


def test_packed_rows_carry_positions_segments_and_mask(prepared):
    out, _ = prepared
    r = PackedBatches(out, "train", 4, 256, seed=0, process_index=0, process_count=1).local_rows(0)
    assert set(r) == {"inputs", "targets", "mask", "positions", "segment_ids"}
    starts = []
    for b in range(4):
        seg, pos = r["segment_ids"][b], r["positions"][b]
        assert np.array_equal(r["mask"][b], (seg > 0).astype(np.float32))
        for s in np.unique(seg[seg > 0]):
            assert np.array_equal(pos[seg == s], np.arange((seg == s).sum()))   # restart at 0
            starts.append(r["inputs"][b][seg == s][0])
    assert len(starts) > 4 and np.mean(np.equal(starts, tokenizer.ByteTokenizer.BOS)) > 0.5
    assert r["mask"].mean() > 0.7


def test_resume_is_exact_and_o1_under_any_process_count(prepared):
    out, _ = prepared

    def make(p=0, n=1, batch=8):
        return PackedBatches(out, "train", batch, 48, seed=3, process_index=p, process_count=n)
    a = make()
    first = [a.local_rows(i) for i in range(3)]
    state = json.loads(json.dumps(a.state()))               # what a checkpoint holds
    rest = [a.local_rows(i) for i in range(3, 40)]          # crosses epoch boundaries
    for n in (1, 2, 4):                                     # saved by 1 process, resumed by n
        parts = [make(p, n) for p in range(n)]
        for b in parts:
            b.restore(state)
        for i, want in enumerate(rest, 3):
            got = [b.local_rows(i) for b in parts]
            assert all(np.array_equal(np.concatenate([g[k] for g in got]), want[k])
                       for k in want)
    half = make(batch=4)                                    # another global batch: same rows
    half.restore(state)
    assert np.array_equal(half.local_rows(3)["inputs"], rest[0]["inputs"][:4])
    assert np.array_equal(half.local_rows(4)["inputs"], rest[0]["inputs"][4:])
    c = make()                                              # no state: replays to step 7
    assert all(np.array_equal(rest[4][k], v) for k, v in c.local_rows(7).items())
    assert all(np.array_equal(first[1][k], v) for k, v in c.local_rows(1).items())   # back

    def restore_cost(step):              # lengths read to resume at `step` and read it
        ref = make()
        ref.global_pieces(step - 1)
        b = make()
        b.restore(json.loads(json.dumps(ref.state())))
        b.local_rows(step)
        return b.stream.lengths_read
    replay = make()
    replay.local_rows(300)
    early, late = restore_cost(20), restore_cost(300)
    assert late <= 2 * early + PACK_BINS and 10 * late < replay.stream.lengths_read
    with pytest.raises(ValueError, match="seq_len 48 there, 32 here"):
        PackedBatches(out, "train", 8, 32, seed=3, process_index=0, process_count=1).restore(
            state)
    with pytest.raises(ValueError, match="data.batch_size=6 must be divisible by the 4"):
        make(0, 4, batch=6)


def test_packed_batch_losses_equal_one_by_one(prepared):
    import jax
    import jax.numpy as jnp
    import optax

    from jaxscale.models.llama import ModelConfig
    from jaxscale.train.state import FunctionalModel
    out, _ = prepared
    cfg = ModelConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_seq_len=128)
    model = FunctionalModel(cfg)
    rng = np.random.default_rng(0)     # any weights will do (model.init is slow on 2 cores)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype),
                          model.abstract_params)
    r = PackedBatches(out, "train", 2, 96, seed=1, process_index=0, process_count=1).local_rows(0)
    apply = jax.jit(model.apply)
    logits = apply(params, jnp.asarray(r["inputs"]), jnp.asarray(r["positions"]),
                   jnp.asarray(r["segment_ids"]))
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, r["targets"]))
    unpacked = apply(params, jnp.asarray(r["inputs"]))    # no segments: leaks across docs
    ce_leak = np.asarray(optax.softmax_cross_entropy_with_integer_labels(unpacked, r["targets"]))
    want, sels = [], []                     # each document alone, at the start of a row
    for b in range(2):
        seg = r["segment_ids"][b]
        for s in np.unique(seg[seg > 0]):
            sel = seg == s
            sels.append((b, sel))
            want.append(np.pad(r["inputs"][b][sel], (0, 96 - sel.sum())))
    alone = apply(params, jnp.asarray(np.stack(want)))
    leaked = False
    for j, (b, sel) in enumerate(sels):
        n = int(sel.sum())
        ref = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
            alone[j, :n], r["targets"][b][sel]))
        np.testing.assert_allclose(ce[b][sel], ref, rtol=2e-5, atol=2e-5)
        leaked |= r["segment_ids"][b][sel][0] > 1 and not np.allclose(ce_leak[b][sel], ref,
                                                                         atol=1e-4)
    n_docs = len(sels)
    assert n_docs >= 4 and leaked          # several documents per row, and the test can fail


def test_make_batches_streams_with_the_steps_shardings(prepared):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    out, _ = prepared
    cfg = DataConfig(shards=str(out), batch_size=8, seq_len=32)
    train, held = make_batches(cfg)
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = {k: NamedSharding(mesh, P("dp", None)) for k in ("inputs", "targets", "mask")}
    batch = train.device_batch(0, sh)
    assert set(batch) == {"inputs", "targets", "mask"} and batch["inputs"].shape == (8, 32)
    assert held.source.split == "heldout" and held.local_rows(0)["inputs"].shape == (8, 32)


def test_packed_batches_train_through_the_step_and_the_pipeline(prepared):
    """The step takes positions and segment ids when data.shards is set; the pipeline engine
    carries them to every stage: its loss and gradients equal the unpipelined step's."""
    import jax

    from jaxscale.analysis.validation import tiny_config
    from jaxscale.train.setup import build
    out, _ = prepared
    common = (f"data.shards={out}", "data.batch_size=8", "data.seq_len=32", "model.n_layers=2",
              "mesh.dp=1", "mesh.tp=1")
    flat = build(tiny_config(*common, "mesh.fsdp=8"))
    piped = build(tiny_config(*common, "mesh.fsdp=4", "mesh.pp=2", "plan.accumulate=2"))
    assert set(flat.batch_shardings()) == {"inputs", "targets", "mask", "positions",
                                           "segment_ids"}
    train, _ = make_batches(flat.cfg.data)
    rows = train.local_rows(0)
    assert rows["segment_ids"].max() > 1                        # several documents in a row
    params = jax.device_get(flat.init_state().params)
    g0, l0, _ = flat.jit_grads()(params, rows)
    g1, l1, _ = piped.jit_grads()(jax.device_put(params, piped.device_shardings.params), rows)
    assert float(l1) == pytest.approx(float(l0), rel=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(g1)), jax.tree.leaves(jax.device_get(g0))):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()))


def test_a_streamed_run_resumes_from_the_data_state_in_its_checkpoint(prepared, tmp_path,
                                                                      monkeypatch):
    """The checkpoint holds the stream's position: a resumed run reads no batch twice (no replay
    of the stream) and its losses are the uninterrupted run's, bitwise; resumed under another
    data layout (dp2 x fsdp4: the global batch cut another way) it reads the same batches once
    each, its losses the uninterrupted run's in another reduction order."""
    import shutil

    from jaxscale.analysis.validation import tiny_config
    from jaxscale.train import loop
    from jaxscale.train.metrics import read_metrics
    out, _ = prepared
    taken = []
    real = PackedBatches._take
    monkeypatch.setattr(PackedBatches, "_take", lambda self: taken.append(self.split) or
                        real(self))
    common = (f"data.shards={out}", "mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", "ckpt.every=3",
              "ckpt.async_save=false")
    loop.train(tiny_config(*common, "train.steps=6"), tmp_path / "a", progress=False)
    loop.train(tiny_config(*common, "train.steps=3"), tmp_path / "b", progress=False)
    meta = json.loads((tmp_path / "b" / "checkpoints" / "3" / "meta" / "metadata").read_text())
    assert meta["data_state"]["step"] == 3 and meta["data_position"] == 3
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    a = read_metrics(tmp_path / "a" / "metrics.jsonl")
    for run, mesh in (("b", ()), ("c", ("mesh.dp=2", "mesh.fsdp=4"))):
        taken.clear()
        summary = loop.train(tiny_config(*common, *mesh, "train.steps=6"), tmp_path / run,
                             progress=False, resume=True)
        assert taken == ["train"] * 3 and summary["data_position"] == 6  # steps 4-6, no replay
        got = [r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl")]
        if run == "b":
            assert got == [r["loss"] for r in a]
        else:
            np.testing.assert_allclose(got, [r["loss"] for r in a], rtol=1e-5)


def test_bad_inputs_are_reported_before_training(prepared, corpus, tmp_path):
    out, _ = prepared
    d, _ = corpus

    def errs(**kw):
        return data_problems(Config(data=DataConfig(**kw)))
    assert "no column data.text_field='body'" in errs(source=str(d / "*.parquet"),
                                                      text_field="body")[0]
    [e] = errs(source=str(d / "*.jsonl"), text_field="body")
    assert "a.jsonl:1: no field data.text_field='body'" in e and "['id', 'text']" in e
    (tmp_path / "empty.txt").write_text("")
    assert "empty.txt is empty (0 bytes)" in errs(source=str(tmp_path / "*.txt"))[0]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    assert errs(source=str(tmp_path / "bad.jsonl")) == []          # the first record is fine...
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON object"):
        shards.prepare([tmp_path / "bad.jsonl"], tokenizer.ByteTokenizer(), tmp_path / "x")
    assert not (tmp_path / "x" / "manifest.json").exists()        # ...and nothing half-written
    assert "no such directory; write the shards first" in errs(shards=str(tmp_path / "no"))[0]
    tok = tokenizer.train_bpe(_docs(50), 300, tmp_path / "tok")
    [e] = errs(shards=str(out), tokenizer=str(tok.path))
    assert "prepared with the bytes tokenizer" in e and "vocabulary 300" in e
    shards.prepare(sorted(d.iterdir()), tok, tmp_path / "bpe")
    cfg = Config(data=DataConfig(shards=str(tmp_path / "bpe"), tokenizer=str(tok.path)))
    assert data_problems(cfg) == []                             # tiny's vocabulary is 320
    import dataclasses
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=256))
    [e] = data_problems(small)
    assert "model.vocab_size=256: must be >= 300" in e


def test_cli_prepare_train_tokenizer_and_refusals(corpus, tmp_path, capsys):
    from jaxscale.cli import main
    d, _ = corpus
    src = f"data.source={d}/*.jsonl,{d}/*.parquet"
    assert main(["data", "prepare", "llama_tiny", "--set", src, "--out", str(tmp_path / "s")]) == 0
    assert shards.read_manifest(tmp_path / "s")["splits"]["train"]["docs"] > 80
    assert main(["data", "prepare", "llama_tiny", "--set", src]) == 2     # no --out, no shards
    assert main(["tokenizer", "train", "--vocab", "300", "--source", f"{d}/*.jsonl",
                 "--out", str(tmp_path / "t")]) == 0
    assert tokenizer.load(tmp_path / "t").vocab_size == 300
    # train refuses bad data before building anything (exit 2, the message on stderr)
    assert main(["train", "llama_tiny", "--set", f"data.shards={tmp_path / 'none'}"]) == 2
    assert main(["train", "llama_tiny", "--set", f"data.source={d}/*.jsonl",
                 "--set", "data.text_field=body"]) == 2
    assert main(["train", "llama_tiny", "--set", f"data.shards={tmp_path / 's'}",
                 "--set", f"data.tokenizer={tmp_path / 't'}"]) == 2
    err = capsys.readouterr().err
    assert "no such directory; write the shards first" in err
    assert "no field data.text_field='body'" in err and "prepared with the bytes tokenizer" in err


FLAT = textwrap.dedent("""
    import json, sys, numpy as np
    from jaxscale.data.stream import Stream
    from jaxscale.data.shards import TokenShards
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    st = Stream(TokenShards(sys.argv[1], "train"), 1024, seed=0, epochs=1)
    n, marks = 0, []
    for i, (row, _) in enumerate(st.rows()):
        n += int(st.read(row)["mask"].sum())
        if i % 800 == 0:
            marks.append(rss())
    print(json.dumps({"tokens": n, "rss": marks}))
""")


def test_streams_a_corpus_larger_than_a_memory_cap(tmp_path):
    """21 MiB of tokens on disk; the streaming process's RSS may grow by at most 6 MiB (a memory
    cap below the corpus size) after its first batches, and every token is read once."""
    rng = np.random.default_rng(0)
    words = np.array([w.encode() for w in WORDS], dtype=object)
    (tmp_path / "src").mkdir()
    for f in range(4):
        docs = [b" ".join(rng.choice(words, size=rng.integers(20, 1500))).decode()
                for _ in range(600)]
        (tmp_path / "src" / f"{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                             for t in docs))
    m = shards.prepare(sorted((tmp_path / "src").iterdir()), tokenizer.ByteTokenizer(),
                       tmp_path / "s", heldout_fraction=0.01, shard_tokens=2**21)
    size = sum(p.stat().st_size for p in (tmp_path / "s").glob("train-*.tokens"))
    cap = 6 * 2**20
    assert size > 3 * cap
    # two malloc arenas: under CPU load glibc may give threads arenas of their own whose freed
    # buffers stay resident
    r = subprocess.run([sys.executable, "-c", FLAT, str(tmp_path / "s")], capture_output=True,
                       text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin",
                                                 "MALLOC_ARENA_MAX": "2"})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    train = m["splits"]["train"]
    assert res["tokens"] == train["n_tokens"] - train["docs"]      # every (input, target) pair
    rss = res["rss"]
    half = len(rss) // 2
    assert len(rss) > 10 and max(rss[2:]) - rss[2] < cap, [x / 2**20 for x in rss]
    assert max(rss[half:]) - rss[half] < 2 * 2**20, [x / 2**20 for x in rss]   # flat
