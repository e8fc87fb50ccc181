"""Data: a byte-level tokenizer, a corpus of real text, and globally sharded batches.

The default corpus is the running Python's own standard library sources (`<stdlib>/*.py`): real
text present on every machine, no download. Documents are split into train and held-out by a
hash of their file name (stable across machines and runs), tokenized as BOS + bytes + EOS and
concatenated. Batch `i` is a deterministic function of (seed, i): windows of `seq_len + 1` tokens
at positions drawn from `numpy.random.default_rng((seed, i))`. Resuming at step i therefore needs
only i, and every process draws the same global batch and keeps its own rows, which it hands to
`jax.make_array_from_process_local_data`; the same code runs single- and multi-process.
"""
from __future__ import annotations

import glob
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; then PAD, BOS, EOS."""
    PAD, BOS, EOS = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(raw, np.uint8).astype(np.int32)

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")


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


def _is_heldout(path: Path, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(path.name.encode()).digest()[:4], "little")
    return (h % 10_000) < fraction * 10_000


@dataclass
class Corpus:
    train: np.ndarray
    heldout: np.ndarray
    n_files: int


def load_corpus(data_cfg, tokenizer: ByteTokenizer | None = None) -> Corpus:
    tok = tokenizer or ByteTokenizer()
    parts = {True: [], False: []}
    total = 0
    files = corpus_files(data_cfg.source)
    for path in files:
        raw = path.read_bytes()
        if total + len(raw) > data_cfg.max_bytes:
            raw = raw[: max(0, data_cfg.max_bytes - total)]
        total += len(raw)
        parts[_is_heldout(path, data_cfg.heldout_fraction)].append(
            np.concatenate([[tok.BOS], tok.encode(raw), [tok.EOS]]).astype(np.int32))
        if total >= data_cfg.max_bytes:
            break
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
    return Corpus(train, heldout, len(files))


class Batches:
    """Deterministic batches: `batch(i)` is the same on every process and after every resume."""

    def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, seed: int,
                 stream: int = 0):
        self.tokens, self.global_batch, self.seq_len = tokens, global_batch, seq_len
        self.seed, self.stream = seed, stream

    def global_rows(self, i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, self.stream, i))
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)
        win = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
        return {"inputs": win[:, :-1], "targets": win[:, 1:],
                "mask": (win[:, 1:] != ByteTokenizer.PAD).astype(np.float32)}

    def local_rows(self, i: int) -> dict[str, np.ndarray]:
        rows = self.global_rows(i)
        n, p = jax.process_count(), jax.process_index()
        per = self.global_batch // n
        return {k: v[p * per:(p + 1) * per] for k, v in rows.items()}

    def device_batch(self, i: int, shardings: dict) -> dict[str, jax.Array]:
        local = self.local_rows(i)
        return {k: jax.make_array_from_process_local_data(shardings[k], v)
                for k, v in local.items()}
