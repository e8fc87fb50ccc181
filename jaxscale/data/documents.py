"""Documents from local files: plain text, JSON lines and Parquet, streamed one at a time.

`data.source` is "stdlib" (this Python's standard-library sources) or comma-separated globs;
`data.format` says how a file holds documents:
  - text:    a file is one document;
  - jsonl:   a line is one document, its text under `data.text_field` (blank lines skipped);
  - parquet: a row is one document, its text in the column `data.text_field` (read with pyarrow
             one record batch at a time, so a file larger than memory streams);
  - auto:    by suffix (.jsonl/.json -> jsonl, .parquet -> parquet, anything else -> text).
`iter_documents` yields `(doc_id, text)` in a stable order (files sorted; rows in file order),
where `doc_id` is "file name:record" (what the held-out split hashes). `check_files` reads only
the first record of each file to report missing or empty files and an unknown text field before
anything is tokenized or trained.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

FORMATS = ("auto", "text", "jsonl", "parquet")


def file_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(path.suffix, "text")


def _jsonl(path: Path, field: str) -> Iterator[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e.msg}); data.format=jsonl "
                                 f"wants one object per line") from None
            if not isinstance(rec, dict) or field not in rec:
                keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ValueError(f"{path}:{n}: no field data.text_field={field!r}; the record "
                                 f"has {keys}: set data.text_field to one of them")
            if not isinstance(rec[field], str):
                raise ValueError(f"{path}:{n}: field {field!r} is a "
                                 f"{type(rec[field]).__name__}, not text")
            yield f"{path.name}:{n}", rec[field]


def _parquet(path: Path, field: str) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:          # pyarrow raises ArrowInvalid and friends
        raise ValueError(f"{path}: not a Parquet file ({e})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(f"{path}: no column data.text_field={field!r}; the file has columns "
                         f"{names}: set data.text_field to one of them")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is not None:
                yield f"{path.name}:{row}", str(text)


def iter_file(path: Path, fmt: str, field: str) -> Iterator[tuple[str, str]]:
    kind = file_format(path, fmt)
    if kind == "jsonl":
        yield from _jsonl(path, field)
    elif kind == "parquet":
        yield from _parquet(path, field)
    else:
        yield path.name, path.read_bytes().decode("utf-8", errors="replace")


def iter_documents(files: list[Path], fmt: str = "auto", field: str = "text",
                   max_bytes: int | None = None) -> Iterator[tuple[str, str]]:
    """(doc_id, text) for every document of `files`, stopping after `max_bytes` of text (the
    document that crosses the cap is cut at it)."""
    total = 0
    for path in files:
        for doc_id, text in iter_file(path, fmt, field):
            if max_bytes is not None and total + len(text) > max_bytes:
                text = text[: max(0, max_bytes - total)]
            total += len(text)
            if text:
                yield doc_id, text
            if max_bytes is not None and total >= max_bytes:
                return


def check_files(files: list[Path], fmt: str, field: str) -> list[str]:
    """One message per file that is empty, unreadable in `fmt`, or lacks the text field (only
    each file's first record is read); [] when all look usable."""
    errs = []
    for path in files:
        if path.stat().st_size == 0:
            errs.append(f"data.source: {path} is empty (0 bytes): remove it or narrow the glob")
            continue
        if file_format(path, fmt) == "text":
            continue                        # a non-empty text file is one document
        try:
            if next(iter_file(path, fmt, field), None) is None:
                errs.append(f"data.source: {path} holds no document (data.format="
                            f"{file_format(path, fmt)})")
        except (ValueError, UnicodeDecodeError) as e:
            errs.append(str(e))
    return errs


def is_heldout(doc_id: str, fraction: float) -> bool:
    """A stable split: a hash of the document id (same on every machine and run)."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:4], "little")
    return (h % 10_000) < fraction * 10_000
