"""Tokenizers: bytes, or a file read by the library that wrote it; training a BPE on local text.

`load(spec)` turns `data.tokenizer` into a tokenizer:
  - "bytes": bytes 0..255 are tokens 0..255, then PAD, BOS, EOS (vocabulary 259; no library);
  - a `tokenizer.json` (Hugging Face `tokenizers`: what Llama-3, Mistral and most Hub directories
    carry; BOS/EOS from the `tokenizer_config.json` beside it, else from the usual names);
  - a SentencePiece `.model` (Llama-2, Gemma): `sentencepiece`;
  - a tiktoken ranks file (`.tiktoken`, or Llama-3's `original/tokenizer.model`: lines of
    "base64-token rank"): `tiktoken`, with `<|bos|>`/`<|eos|>` appended after the ranks;
  - a directory (a Hugging Face checkpoint): its tokenizer.json, else its tokenizer.model.
Every tokenizer has `vocab_size`, `bos_id`/`eos_id`/`pad_id` (None when it has none),
`encode(text) -> int32 array` (no special tokens), `encode_batch`, `decode(ids)` and `describe()`
(kind, path, sha256, vocab size: what `jaxscale data prepare` records in its manifest).
`document(ids)` frames one document as [BOS] + ids + [EOS] (each only where the tokenizer has it).

`train_bpe(texts, vocab, out)` trains a byte-level BPE with `tokenizers` (every byte is in the
initial alphabet, so any text encodes) and saves tokenizer.json: `jaxscale tokenizer train`.
The libraries are imported on first use, so `import jaxscale` does not pay for them.
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np

SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")      # what train_bpe adds (ids 0, 1, 2)
_BOS_NAMES = ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "[BOS]")
_EOS_NAMES = ("<|eos|>", "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[EOS]")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")
#: the pre-tokenizer split of cl100k / Llama-3 (tiktoken needs one; ranks files do not carry it)
TIKTOKEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class Tokenizer:
    """What every tokenizer offers; subclasses set the ids and implement `_encode`/`decode`."""
    kind = "?"
    path: Path | None = None
    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None

    def encode(self, text: str | bytes) -> np.ndarray:
        return np.asarray(self._encode(_text(text)), np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def document(self, ids: np.ndarray) -> np.ndarray:
        parts = [[self.bos_id]] if self.bos_id is not None else []
        parts += [ids] + ([[self.eos_id]] if self.eos_id is not None else [])
        return np.concatenate(parts).astype(np.int32)

    def describe(self) -> dict:
        return {"kind": self.kind, "path": str(self.path) if self.path else None,
                "sha256": _sha256(self.path) if self.path else None,
                "vocab_size": int(self.vocab_size), "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id}


def _text(text: str | bytes) -> str:
    return text.decode("utf-8", errors="replace") if isinstance(text, (bytes, bytearray)) else text


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ByteTokenizer(Tokenizer):
    """Bytes 0..255 are tokens 0..255; then PAD, BOS, EOS."""
    kind = "bytes"
    PAD, BOS, EOS = 256, 257, 258
    vocab_size = 259
    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(raw, np.uint8).astype(np.int32)

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A `tokenizers` tokenizer.json (special tokens are never added by `encode`)."""
    kind = "tokenizers"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok
        self.path = Path(path)
        try:
            self.tok = _Tok.from_file(str(path))
        except Exception as e:        # the Rust side raises its own exception type
            raise ValueError(f"data.tokenizer={str(path)!r}: not a readable tokenizer.json "
                             f"({e})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        named = _config_tokens(self.path.parent / "tokenizer_config.json")
        self.bos_id = self._find(named.get("bos_token"), _BOS_NAMES)
        self.eos_id = self._find(named.get("eos_token"), _EOS_NAMES)
        self.pad_id = self._find(named.get("pad_token"), _PAD_NAMES)

    def _find(self, named: str | None, names) -> int | None:
        for name in ([named] if named else []) + list(names):
            i = self.tok.token_to_id(name)
            if i is not None:
                return int(i)
        return None

    def _encode(self, text: str):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self.tok.encode_batch([_text(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encs]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _config_tokens(path: Path) -> dict:
    """bos/eos/pad token strings from a Hugging Face tokenizer_config.json (str or {content})."""
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[key] = v
    return out


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file (BOS/EOS/PAD from the model; -1 there means none)."""
    kind = "sentencepiece"

    def __init__(self, path: Path):
        import sentencepiece as spm
        self.path = Path(path)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"data.tokenizer={str(path)!r}: not a SentencePiece model "
                             f"({e})") from None
        self.vocab_size = int(self.sp.vocab_size())
        ids = (self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id())
        self.bos_id, self.eos_id, self.pad_id = (int(i) if i >= 0 else None for i in ids)

    def _encode(self, text: str):
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int32) for ids in self.sp.encode([_text(t) for t in texts])]

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


class TiktokenTokenizer(Tokenizer):
    """A tiktoken ranks file ("base64-token rank" per line); `<|bos|>`, `<|eos|>` follow the
    ranks unless `specials` names others (a dict of name -> id)."""
    kind = "tiktoken"

    def __init__(self, path: Path, specials: dict[str, int] | None = None):
        import tiktoken
        self.path = Path(path)
        ranks = read_tiktoken_ranks(self.path)
        n = max(ranks.values()) + 1
        specials = specials or {"<|bos|>": n, "<|eos|>": n + 1}
        self.enc = tiktoken.Encoding(name=self.path.stem, pat_str=TIKTOKEN_PATTERN,
                                     mergeable_ranks=ranks, special_tokens=specials)
        self.vocab_size = int(self.enc.n_vocab)
        self.bos_id = specials.get("<|bos|>", specials.get("<|begin_of_text|>"))
        self.eos_id = specials.get("<|eos|>", specials.get("<|end_of_text|>"))

    def _encode(self, text: str):
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int32)
                for ids in self.enc.encode_ordinary_batch([_text(t) for t in texts])]

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids if int(i) < self.vocab_size])


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file (what `tiktoken.load.load_tiktoken_bpe` reads, without its
    path-keyed cache, which would serve a stale copy of a rewritten local file)."""
    ranks = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"data.tokenizer={str(path)!r}:{n}: not a tiktoken ranks line "
                             f"('<base64 token> <rank>')") from None
    if not ranks:
        raise ValueError(f"data.tokenizer={str(path)!r} is empty")
    return ranks


def _is_tiktoken_file(path: Path) -> bool:
    head = path.read_bytes()[:4096].split(b"\n")[0].split()
    if len(head) != 2 or not head[1].isdigit():
        return False
    try:
        base64.b64decode(head[0], validate=True)
        return True
    except ValueError:
        return False


def resolve(spec: str | Path) -> Path:
    """The tokenizer file that `spec` (a file or a Hugging Face directory) names."""
    p = Path(spec)
    if p.is_dir():
        for name in ("tokenizer.json", "tokenizer.model", "original/tokenizer.model"):
            if (p / name).is_file():
                return p / name
        raise ValueError(f"data.tokenizer={str(spec)!r}: the directory has no tokenizer.json or "
                         f"tokenizer.model")
    if not p.is_file():
        raise ValueError(f"data.tokenizer={str(spec)!r}: no such file; give 'bytes', a "
                         f"tokenizer.json, a SentencePiece .model, a .tiktoken file or a Hugging "
                         f"Face directory (train one: jaxscale tokenizer train --vocab N)")
    if p.stat().st_size == 0:
        raise ValueError(f"data.tokenizer={str(spec)!r} is an empty file")
    return p


def load(spec: str | Path) -> Tokenizer:
    """The tokenizer named by `data.tokenizer` (see the module docstring)."""
    if str(spec) == "bytes":
        return ByteTokenizer()
    p = resolve(spec)
    if p.suffix == ".json":
        return HFTokenizer(p)
    if p.suffix == ".tiktoken" or _is_tiktoken_file(p):
        return TiktokenTokenizer(p)
    return SentencePieceTokenizer(p)


def from_directory(path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face directory, or None when it carries none (a tokenizer file
    that is there but unreadable is an error)."""
    p = Path(path)
    names = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")
    if not p.is_dir() or not any((p / n).is_file() for n in names):
        return None
    return load(resolve(p))


def vocab_problem(tok_vocab: int, model_vocab: int, what: str) -> str | None:
    """The message when the model's embedding cannot hold the tokenizer's ids, else None."""
    if model_vocab >= tok_vocab:
        return None
    return (f"model.vocab_size={model_vocab}: must be >= {tok_vocab}, the vocabulary of {what}; "
            f"smaller, the data's token ids {model_vocab}..{tok_vocab - 1} fall outside the "
            f"embedding: set model.vocab_size>={tok_vocab} (a multiple of 64 shards evenly)")


def train_bpe(texts, vocab: int, out: str | Path) -> HFTokenizer:
    """Train a byte-level BPE of `vocab` tokens (3 specials: pad, bos, eos) on the iterable of
    strings `texts`; save `out`/tokenizer.json (and a tokenizer_config.json naming the specials)."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab < len(alphabet) + len(SPECIALS):
        raise ValueError(f"--vocab {vocab}: a byte-level BPE needs at least "
                         f"{len(alphabet) + len(SPECIALS)} tokens (256 bytes + 3 specials)")
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"pad_token": SPECIALS[0], "bos_token": SPECIALS[1], "eos_token": SPECIALS[2]}, indent=2))
    return HFTokenizer(out / "tokenizer.json")
