"""Data: a corpus of real text and globally sharded batches, in memory or streamed from shards.

The default corpus is the running Python's own standard library sources (`<stdlib>/*.py`): real
text present on every machine, no download. Documents are split into train and held-out by a
hash of their file name (stable across machines and runs), tokenized as BOS + bytes + EOS and
concatenated. Batch `i` is a deterministic function of (seed, i): windows of `seq_len + 1` tokens
at positions drawn from `numpy.random.default_rng((seed, i))`. Resuming at step i therefore needs
only i, and every process draws the same global batch and keeps its own rows, which it hands to
`jax.make_array_from_process_local_data`; the same code runs single- and multi-process.

That in-memory path is the default (`data.tokenizer=bytes`, `data.shards=""`). `data.tokenizer`
may name another tokenizer (`jaxscale.data.tokenizer`): the same windows, over its ids. With
`data.shards` set (a directory written by `jaxscale data prepare`, `jaxscale.data.shards`), training
streams packed documents instead (`jaxscale.data.stream.PackedBatches`): memory flat in corpus size,
no window crossing a document, positions and segment ids per document. `make_batches(data_cfg)`
picks the path; `problems(data_cfg, model_vocab)` says what stops the data from being read (every
source glob, file, text field, tokenizer and shard directory; the model's vocabulary against the
tokenizer's), reading only the first record of each file.
"""
from __future__ import annotations

import glob
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from jaxscale.data import tokenizer as tokenizer_lib
from jaxscale.data.tokenizer import ByteTokenizer, Tokenizer


def corpus_files(source: str) -> list[Path]:
    if source == "stdlib":
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    else:
        files = sorted({Path(p) for pat in source.split(",") if pat.strip()
                        for p in glob.glob(pat.strip(), recursive=True) if Path(p).is_file()})
    if not files:
        raise ValueError(f"data.source={source!r} matched no files; give 'stdlib' or "
                         f"comma-separated globs of text files (e.g. 'docs/**/*.md')")
    return files


def source_problems(source: str) -> list[str]:
    """One message per `data.source` glob that matches no file (nothing is read); [] if valid."""
    if source == "stdlib":
        return []
    globs = [pat.strip() for pat in source.split(",") if pat.strip()]
    if not globs:
        return [f"data.source={source!r}: give 'stdlib' or comma-separated globs of text files "
                f"(e.g. 'docs/**/*.md')"]
    return [f"data.source={source!r}: the glob {pat!r} matches no file" + (
                f" ({pat!r} is a directory: add a pattern, e.g. '{pat.rstrip('/')}/**/*.txt')"
                if Path(pat).is_dir() else "")
            for pat in globs if not any(Path(p).is_file() for p in glob.iglob(pat, recursive=True))]


@dataclass
class Corpus:
    train: np.ndarray
    heldout: np.ndarray
    n_files: int
    pad_id: int | None = ByteTokenizer.PAD      # the tokenizer's padding id (never in the text)


def load_corpus(data_cfg, tokenizer: Tokenizer | None = None) -> Corpus:
    """Every file of `data.source` (up to `data.max_bytes`), one document each, tokenized with
    `tokenizer` (default: `data.tokenizer`) as [BOS] ids [EOS] and concatenated per split."""
    if getattr(data_cfg, "shards", ""):
        raise ValueError(f"data.shards={data_cfg.shards!r} is set: shards stream through "
                         f"jaxscale.data.make_batches (packed), not load_corpus's windows; "
                         f"this caller reads the in-memory corpus only: unset data.shards")
    tok = tokenizer or tokenizer_lib.load(getattr(data_cfg, "tokenizer", "bytes"))
    files = corpus_files(data_cfg.source)
    docs = list(load_documents(data_cfg, files, tok))
    parts = {True: [], False: []}
    for (held, _), ids in zip(docs, tok.encode_batch([raw for _, raw in docs])):
        parts[held].append(tok.document(ids))
    need = data_cfg.seq_len + 2
    if not parts[True]:   # tiny custom corpora: hold out the tail of the text instead
        flat = np.concatenate(parts[False])
        cut = int(len(flat) * (1 - data_cfg.heldout_fraction))
        parts = {False: [flat[:cut]], True: [flat[cut:]]}
    train = np.concatenate(parts[False]) if parts[False] else np.zeros(0, np.int32)
    heldout = np.concatenate(parts[True])
    for name, arr in (("training", train), ("held-out", heldout)):
        if len(arr) < need:
            raise ValueError(f"the {name} split has {len(arr)} tokens, fewer than seq_len+2="
                             f"{need}: use more text or a shorter data.seq_len")
    return Corpus(train, heldout, len(files), tok.pad_id)


class Batches:
    """Deterministic batches: `batch(i)` is the same on every process and after every resume."""

    def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, seed: int,
                 stream: int = 0, pad_id: int | None = ByteTokenizer.PAD):
        self.tokens, self.global_batch, self.seq_len = tokens, global_batch, seq_len
        self.seed, self.stream, self.pad_id = seed, stream, pad_id

    def global_rows(self, i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, self.stream, i))
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)
        win = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
        return {"inputs": win[:, :-1], "targets": win[:, 1:],
                "mask": (win[:, 1:] != (-1 if self.pad_id is None else self.pad_id)
                         ).astype(np.float32)}

    def local_rows(self, i: int) -> dict[str, np.ndarray]:
        rows = self.global_rows(i)
        n, p = jax.process_count(), jax.process_index()
        per = self.global_batch // n
        return {k: v[p * per:(p + 1) * per] for k, v in rows.items()}

    def device_batch(self, i: int, shardings: dict) -> dict[str, jax.Array]:
        local = self.local_rows(i)
        return {k: jax.make_array_from_process_local_data(shardings[k], v)
                for k, v in local.items()}


def _tokenizer_name(data_cfg) -> str:
    return ("the byte tokenizer (256 bytes + PAD, BOS, EOS)" if data_cfg.tokenizer == "bytes"
            else f"data.tokenizer={data_cfg.tokenizer!r}")


def load_documents(data_cfg, files: list[Path], tok: Tokenizer):
    """(heldout?, framed document) for every document of `files` (in-memory path): a text file
    is one document, read as bytes (capped at data.max_bytes); jsonl/parquet records through
    `jaxscale.data.documents`, split by a hash of each record's id."""
    from jaxscale.data.documents import file_format, is_heldout, iter_file
    total = 0
    for path in files:
        kind = file_format(path, getattr(data_cfg, "format", "text"))
        recs = ([(path.name, path.read_bytes())] if kind == "text" else
                ((i, t.encode("utf-8")) for i, t in iter_file(path, kind, data_cfg.text_field)))
        for doc_id, raw in recs:
            raw = raw[: max(0, data_cfg.max_bytes - total)]
            total += len(raw)
            yield is_heldout(doc_id, data_cfg.heldout_fraction), raw
            if total >= data_cfg.max_bytes:
                return


def problems(data_cfg, model_vocab: int) -> list[str]:
    """What stops training from reading the data, one message each (see the module docstring);
    nothing is written, and each file's first record at most is read."""
    from jaxscale.data import shards as shards_lib
    from jaxscale.data.documents import check_files
    errs = []
    try:
        tok = tokenizer_lib.load(data_cfg.tokenizer)
    except ValueError as e:
        tok, errs = None, [str(e)]
    if data_cfg.shards:
        try:
            m = shards_lib.read_manifest(data_cfg.shards)
        except ValueError as e:
            return errs + [str(e)]
        if m["splits"]["heldout"]["docs"] == 0:
            errs.append(f"data.shards={data_cfg.shards!r} has no held-out document (evaluation "
                        f"reads them): prepare again with a larger data.heldout_fraction")
        have = m["tokenizer"]
        if tok is not None and (tok.describe()["sha256"], tok.kind) != (have["sha256"],
                                                                       have["kind"]):
            errs.append(f"data.shards={data_cfg.shards!r} was prepared with the {have['kind']} "
                        f"tokenizer {have['path'] or 'bytes'} (vocabulary {have['vocab_size']}), "
                        f"but data.tokenizer={data_cfg.tokenizer!r} ({tok.kind}, vocabulary "
                        f"{tok.vocab_size}): set data.tokenizer={have['path'] or 'bytes'} or "
                        f"prepare the shards again")
        errs += [e for e in [tokenizer_lib.vocab_problem(
            have["vocab_size"], model_vocab, f"the tokenizer of data.shards ({have['kind']})")]
            if e]
        return errs
    glob_errs = source_problems(data_cfg.source)
    errs += glob_errs
    if not glob_errs and data_cfg.source != "stdlib":
        errs += check_files(corpus_files(data_cfg.source), data_cfg.format, data_cfg.text_field)
    if tok is not None:
        errs += [e for e in [tokenizer_lib.vocab_problem(tok.vocab_size, model_vocab,
                                                         _tokenizer_name(data_cfg))] if e]
    return errs


def make_batches(data_cfg, process_index: int | None = None, process_count: int | None = None):
    """(training batches, held-out batches) for `data_cfg`: `Batches` over the in-memory corpus,
    or `stream.PackedBatches` over `data.shards`. Both have `device_batch(i, shardings)`."""
    if data_cfg.shards:
        from jaxscale.data.stream import PackedBatches
        return tuple(PackedBatches(data_cfg.shards, split, data_cfg.batch_size, data_cfg.seq_len,
                                   data_cfg.seed, stream, process_index, process_count)
                     for stream, split in enumerate(("train", "heldout")))
    corpus = load_corpus(data_cfg)
    return (Batches(corpus.train, data_cfg.batch_size, data_cfg.seq_len, data_cfg.seed,
                    pad_id=corpus.pad_id),
            Batches(corpus.heldout, data_cfg.batch_size, data_cfg.seq_len, data_cfg.seed, 1,
                    pad_id=corpus.pad_id))
