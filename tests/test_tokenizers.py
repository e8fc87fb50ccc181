"""Tokenizers through their libraries (tokenizers, SentencePiece, tiktoken) built here on local
text, round trips on non-ASCII text, the vocabulary checks, and `hf.load` taking a directory's
tokenizer."""
import base64
import dataclasses

import numpy as np
import pytest

from jaxscale.config import Config, DataConfig, data_problems
from jaxscale.data import tokenizer as T

TEXT = ("déjà vu — naïve façade; Ελληνικά, русский, 日本語のテキスト, 한국어, "
        "emoji 🙂🚀, math ∑∫√, def f(x):\n\treturn x ** 2  # ✓\n")
CORPUS = [TEXT * 3, "The quick brown fox jumps over the lazy dog. " * 20,
          "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. " * 10,
          "def add(a, b):\n    return a + b\n" * 30]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    T.train_bpe(CORPUS, 400, d)
    return d


def test_bytes_round_trip():
    tok = T.load("bytes")
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and ids.max() < 256
    doc = tok.document(ids)
    assert doc[0] == tok.bos_id == 257 and doc[-1] == tok.eos_id == 258


def test_tokenizers_bpe_round_trip(bpe_dir):
    tok = T.load(bpe_dir / "tokenizer.json")
    assert isinstance(tok, T.HFTokenizer) and tok.vocab_size == 400
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)      # from tokenizer_config.json
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode())                            # merges were learnt
    assert [x.tolist() for x in tok.encode_batch([TEXT, "ok"])] == [ids.tolist(),
                                                                     tok.encode("ok").tolist()]
    assert T.load(bpe_dir).path == tok.path                         # a directory finds it
    d = tok.describe()
    assert d["kind"] == "tokenizers" and d["vocab_size"] == 400 and len(d["sha256"]) == 64


def test_sentencepiece_round_trip(tmp_path):
    import sentencepiece as spm
    path = tmp_path / "sp.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 4), model_writer=f,
                                       vocab_size=400, model_type="bpe", byte_fallback=True,
                                       character_coverage=1.0, hard_vocab_limit=False,
                                       normalization_rule_name="identity",   # as Llama-2's
                                       remove_extra_whitespaces=False, minloglevel=2)
    tok = T.load(path)
    assert isinstance(tok, T.SentencePieceTokenizer) and 259 < tok.vocab_size <= 400
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    unseen = "unseen: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃"
    assert tok.decode(tok.encode(unseen)) == unseen            # through byte fallback


def test_tiktoken_round_trip(tmp_path):
    ranks = [bytes([i]) for i in range(256)]
    ranks += [b"th", b"the", b" the", b"in", b"ing", "é".encode()]
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    tok = T.load(path)
    assert isinstance(tok, T.TiktokenTokenizer) and tok.vocab_size == len(ranks) + 2
    assert (tok.bos_id, tok.eos_id) == (len(ranks), len(ranks) + 1)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.encode(" the")[0] == ranks.index(b" the") and len(tok.encode("é")) == 1
    plain = tmp_path / "tokenizer.model"          # Llama-3's name for a ranks file: sniffed
    plain.write_bytes(path.read_bytes())
    assert isinstance(T.load(plain), T.TiktokenTokenizer)


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        T.load(tmp_path / "nope.json")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ValueError, match="is an empty file"):
        T.load(tmp_path / "empty.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable tokenizer.json"):
        T.load(tmp_path / "bad.json")
    (tmp_path / "bad.model").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        T.load(tmp_path / "bad.model")
    with pytest.raises(ValueError, match="has no tokenizer.json or tokenizer.model"):
        T.load(tmp_path)
    with pytest.raises(ValueError, match="at least 259"):
        T.train_bpe(CORPUS, 100, tmp_path / "small")


def test_vocab_mismatch_names_both_sizes(bpe_dir):
    cfg = Config(data=DataConfig(tokenizer=str(bpe_dir / "tokenizer.json")))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=320))
    [err] = data_problems(cfg)
    assert "model.vocab_size=320: must be >= 400" in err and "tokenizer.json" in err
    ok = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=448))
    assert data_problems(ok) == []
    assert "no such file" in data_problems(Config(data=DataConfig(tokenizer="/nope.json")))[0]


def test_in_memory_corpus_with_a_bpe(bpe_dir, tmp_path):
    from jaxscale.data import load_corpus, make_batches
    (tmp_path / "a.txt").write_text(TEXT * 40)
    cfg = DataConfig(source=str(tmp_path / "*.txt"), seq_len=16, batch_size=4,
                     tokenizer=str(bpe_dir))
    c = load_corpus(cfg)
    tok = T.load(bpe_dir)
    assert c.train[0] == tok.bos_id and c.pad_id == tok.pad_id
    assert tok.decode(np.concatenate([c.train, c.heldout])) == TEXT * 40
    train, _ = make_batches(cfg)
    assert train.global_rows(0)["mask"].all()     # id 256 is a real token here, not padding


def test_hf_load_takes_the_directorys_tokenizer(tmp_path, bpe_dir):
    import shutil

    import jax

    from jaxscale.interop import hf
    from jaxscale.models.llama import ModelConfig
    from jaxscale.train.state import FunctionalModel
    mcfg = ModelConfig(vocab_size=448, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64)
    hf.export(tmp_path / "m", FunctionalModel(mcfg).init(jax.random.key(0)), mcfg)
    assert hf.load(tmp_path / "m", Config(mesh=dataclasses.replace(
        Config().mesh, dp=1, fsdp=1, tp=1)), jax.devices()[:1]).tokenizer is None
    shutil.copy(bpe_dir / "tokenizer.json", tmp_path / "m")
    shutil.copy(bpe_dir / "tokenizer_config.json", tmp_path / "m")
    one = Config(mesh=dataclasses.replace(Config().mesh, dp=1, fsdp=1, tp=1))
    loaded = hf.load(tmp_path / "m", one, jax.devices()[:1])
    assert loaded.tokenizer.vocab_size == 400 and loaded.tokenizer.bos_id == 1
    assert loaded.cfg.data.tokenizer == str(tmp_path / "m" / "tokenizer.json")
    small = ModelConfig(vocab_size=320, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64)
    hf.export(tmp_path / "s", FunctionalModel(small).init(jax.random.key(0)), small)
    shutil.copy(bpe_dir / "tokenizer.json", tmp_path / "s")
    with pytest.raises(ValueError, match="vocab_size 320 is smaller than its tokenizer's "
                                         "vocabulary \\(400\\)"):
        hf.load(tmp_path / "s", one, jax.devices()[:1])
