"""On-disk token shards: written once by `jaxscale data prepare`, read one document at a time.

Layout of a shards directory:
    manifest.json              written last (its presence means the shards are complete)
    train-00000.tokens         the documents' tokens back to back ([BOS] ids [EOS] each), raw
                               little-endian uint16 when the vocabulary fits, else int32
    train-00000.index          int64 offsets, one per document plus the end (n_docs + 1)
    heldout-00000.tokens/.index
The manifest records the tokenizer (`Tokenizer.describe()`: kind, path, sha256, vocabulary), the
dtype, the source, and per split its shards with their document and token counts. Documents go
to the held-out split by a hash of their id (`documents.is_heldout`), as in the in-memory path.

`TokenShards(directory, split)` is a random-access source (`len`, `[i]` -> int32 tokens of
document i, `length(i)`, `read(i, start, stop)`): it keeps only the manifest's per-shard counts
in memory and reads a document's length with one `os.pread` (its two offsets) and its tokens with
another, so memory does not grow with the corpus (no memory map either: mapped pages would count
in the process's RSS).
"""
from __future__ import annotations

import bisect
import json
import os
import time
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
VERSION = 1
SPLITS = ("train", "heldout")


class _ShardWriter:
    def __init__(self, out: Path, split: str, dtype, shard_tokens: int):
        self.out, self.split, self.dtype, self.cap = out, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self._f = None

    def _open(self):
        name = f"{self.split}-{len(self.shards):05d}"
        self._f = open(self.out / f"{name}.tokens", "wb")
        self._offsets = [0]
        self.shards.append({"tokens": f"{name}.tokens", "index": f"{name}.index",
                            "docs": 0, "n_tokens": 0})

    def add(self, doc: np.ndarray) -> None:
        if self._f is None:
            self._open()
        self._f.write(doc.astype(self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + len(doc))
        if self._offsets[-1] >= self.cap:
            self.close()

    def close(self) -> None:
        if self._f is None:
            return
        self._f.close()
        self._f = None
        shard = self.shards[-1]
        np.asarray(self._offsets, "<i8").tofile(self.out / shard["index"])
        shard["docs"], shard["n_tokens"] = len(self._offsets) - 1, int(self._offsets[-1])


def prepare(files: list[Path], tok, out: str | Path, fmt: str = "auto", field: str = "text",
            heldout_fraction: float = 0.05, shard_tokens: int = 64 * 2**20,
            max_bytes: int | None = None, source: str = "", batch_docs: int = 256,
            progress=None) -> dict:
    """Tokenize the documents of `files` with `tok` into shards under `out`; returns the manifest.
    Documents are encoded `batch_docs` at a time (the Rust tokenizers use every core)."""
    from jaxscale.data.documents import is_heldout, iter_documents
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        (out / MANIFEST).unlink()       # a half-rewritten directory must never look complete
    dtype = "<u2" if tok.vocab_size <= 2**16 else "<i4"
    writers = {s: _ShardWriter(out, s, dtype, shard_tokens) for s in SPLITS}
    t0, n_bytes, pending = time.time(), 0, []

    def flush():
        for (doc_id, _), ids in zip(pending, tok.encode_batch([t for _, t in pending])):
            writers["heldout" if is_heldout(doc_id, heldout_fraction) else "train"].add(
                tok.document(ids))
        pending.clear()
    for doc_id, text in iter_documents(files, fmt, field, max_bytes):
        pending.append((doc_id, text))
        n_bytes += len(text.encode("utf-8", errors="replace"))
        if len(pending) >= batch_docs:
            flush()
            if progress:
                progress(n_bytes)
    flush()
    for w in writers.values():
        w.close()
    if not writers["train"].shards:
        raise ValueError(f"data.source={source!r}: no document reached the training split "
                         f"(all {sum(s['docs'] for s in writers['heldout'].shards)} went to "
                         f"held-out): add text or lower data.heldout_fraction")
    manifest = {"version": VERSION, "tokenizer": tok.describe(), "dtype": dtype,
                "source": source, "format": fmt, "text_field": field,
                "heldout_fraction": heldout_fraction, "text_bytes": n_bytes,
                "seconds": round(time.time() - t0, 3),
                "splits": {s: {"docs": sum(x["docs"] for x in w.shards),
                               "n_tokens": sum(x["n_tokens"] for x in w.shards),
                               "shards": w.shards} for s, w in writers.items()}}
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a shards directory; a clear error when it is missing or incomplete."""
    d = Path(directory)
    path = d / MANIFEST
    if not path.is_file():
        why = "no such directory" if not d.exists() else f"no {MANIFEST} in it"
        raise ValueError(f"data.shards={str(directory)!r}: {why}; write the shards first: "
                         f"jaxscale data prepare <experiment> --set data.shards={directory} ...")
    m = json.loads(path.read_text())
    if m.get("version") != VERSION:
        raise ValueError(f"data.shards={str(directory)!r}: manifest version "
                         f"{m.get('version')!r}, this jaxscale reads {VERSION}: prepare again")
    for split in SPLITS:
        for s in m["splits"][split]["shards"]:
            for key in ("tokens", "index"):
                if not (d / s[key]).is_file():
                    raise ValueError(f"data.shards={str(directory)!r}: {s[key]} is listed in "
                                     f"the manifest but missing: prepare again")
    return m


class TokenShards:
    """Random access to the documents of one split (see the module docstring)."""

    def __init__(self, directory: str | Path, split: str = "train", manifest: dict | None = None):
        self.dir = Path(directory)
        self.manifest = manifest or read_manifest(directory)
        self.split = split
        info = self.manifest["splits"][split]
        if info["docs"] == 0:
            raise ValueError(f"data.shards={str(directory)!r}: the {split} split has no document: "
                             f"add text or change data.heldout_fraction, then prepare again")
        self.dtype = np.dtype(self.manifest["dtype"])
        self._shards = info["shards"]
        self._starts = np.cumsum([0] + [s["docs"] for s in self._shards]).tolist()
        self._fds: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return self._starts[-1]

    def _fd(self, k: int) -> tuple[int, int]:
        if k not in self._fds:
            s = self._shards[k]
            self._fds[k] = (os.open(self.dir / s["index"], os.O_RDONLY),
                            os.open(self.dir / s["tokens"], os.O_RDONLY))
        return self._fds[k]

    def _offsets(self, i: int) -> tuple[int, int, int]:
        """(shard, first token, end) of document i: one pread of its two index entries."""
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} of {len(self)}")
        k = bisect.bisect_right(self._starts, i) - 1
        lo, hi = np.frombuffer(os.pread(self._fd(k)[0], 16, 8 * (i - self._starts[k])), "<i8")
        return k, int(lo), int(hi)

    def length(self, i: int) -> int:
        """Tokens in document i (its index entries only)."""
        _, lo, hi = self._offsets(i)
        return hi - lo

    def read(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens [start, stop) of document i (default: all) as int32."""
        k, lo, hi = self._offsets(i)
        stop = hi - lo if stop is None else min(stop, hi - lo)
        size = self.dtype.itemsize
        raw = os.pread(self._fd(k)[1], (stop - start) * size, (lo + start) * size)
        return np.frombuffer(raw, self.dtype).astype(np.int32)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.read(i)

    def lengths(self) -> np.ndarray:
        """Every document's length (reads the index files: tests and statistics)."""
        return np.concatenate([np.diff(np.fromfile(self.dir / s["index"], "<i8"))
                               for s in self._shards])

    def __del__(self):
        for fds in getattr(self, "_fds", {}).values():
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
