import numpy as np
import pytest

from jaxscale.config import DataConfig
from jaxscale.data import Batches, load_corpus
from jaxscale.data.tokenizer import ByteTokenizer


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo'  # ✓\n"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text


def test_stdlib_corpus_split_is_disjoint_and_stable():
    cfg = DataConfig(max_bytes=2_000_000, heldout_fraction=0.1)
    a, b = load_corpus(cfg), load_corpus(cfg)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.heldout, b.heldout)
    assert len(a.heldout) > 0.02 * len(a.train)
    assert ByteTokenizer.BOS in a.train and ByteTokenizer.EOS in a.heldout


def test_batches_deterministic_and_resumable():
    tokens = np.arange(10_000, dtype=np.int32)
    b1, b2 = Batches(tokens, 8, 16, seed=3), Batches(tokens, 8, 16, seed=3)
    first = [b1.global_rows(i)["inputs"] for i in range(5)]
    # "resume" at step 3: same batch as the uninterrupted run
    assert np.array_equal(b2.global_rows(3)["inputs"], first[3])
    assert not np.array_equal(first[0], first[1])
    r = b1.global_rows(0)
    assert np.array_equal(r["targets"][:, :-1], r["inputs"][:, 1:])     # shifted by one
    assert not np.array_equal(Batches(tokens, 8, 16, seed=4).global_rows(0)["inputs"], first[0])


def test_custom_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 200)
    c = load_corpus(DataConfig(source=str(tmp_path / "*.txt"), seq_len=16))
    assert len(c.train) + len(c.heldout) == 2400 + 2
    with pytest.raises(ValueError, match="matched no files"):
        load_corpus(DataConfig(source=str(tmp_path / "*.md")))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        load_corpus(DataConfig(source=str(tmp_path / "*.txt"), seq_len=2000))


def test_make_batches_default_is_the_in_memory_windows(tmp_path):
    from jaxscale.data import make_batches
    cfg = DataConfig(max_bytes=300_000, seq_len=32, batch_size=4)
    train, held = make_batches(cfg)
    c = load_corpus(cfg)
    for got, want in ((train, Batches(c.train, 4, 32, 0)), (held, Batches(c.heldout, 4, 32, 0, 1))):
        assert all(np.array_equal(got.global_rows(2)[k], want.global_rows(2)[k])
                   for k in ("inputs", "targets", "mask"))
    with pytest.raises(ValueError, match="data.shards='x' is set"):
        load_corpus(DataConfig(shards="x"))


def test_jsonl_documents_in_memory(tmp_path):
    import json
    lines = [{"text": f"record {i} héllo " * 20, "meta": i} for i in range(30)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    c = load_corpus(DataConfig(source=str(tmp_path / "*.jsonl"), seq_len=16))
    toks = np.concatenate([c.train, c.heldout])
    docs = np.split(toks, np.flatnonzero(toks == ByteTokenizer.BOS)[1:])
    assert len(docs) == 30 and len(c.heldout) > 0                # a record is a document
    assert sorted(ByteTokenizer().decode(d) for d in docs) == sorted(r["text"] for r in lines)
