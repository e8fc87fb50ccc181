"""Declared ranges: every config field states its valid values next to its default.

    seq_len: int = positive(128)                        # an integer >= 1
    lr: float = positive(3e-3)                          # a number > 0
    zero: int = ranged(0, lo=0, hi=3)                   # an integer between 0 and 3
    dp: int = ranged(1, lo=1, also=(-1,))               # -1 or an integer >= 1
    precision: str = one_of("fp32", "fp32", "bf16", "fp16")

`problems(cfg, prefix)` walks a (nested) frozen dataclass and returns one message per field whose
value has the wrong type (from the annotation) or lies outside its declared range, e.g.
`data.seq_len=0: must be an integer >= 1`. Checks that relate several fields live with them: a
dataclass may define `relations() -> list[str]`, run after its fields' checks. `check(cls, name,
value, key)` checks one value against a field's declaration (command-line shorthands such as
`train --steps`, which is `train.steps`); `arg(...)` is an argparse `type=` for a subcommand's own
numbers (argparse then reports them: exit 2, no traceback); `dir_problem(path, key)` checks an
output directory before anything is written. No JAX here: the CLI builds its parser before JAX
starts (it must first set up the simulated devices).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path

_KEY = "jaxscale.range"
_NOUNS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


@dataclass(frozen=True)
class Rule:
    """A field's valid values: inclusive `lo`/`hi`, exclusive `above`/`below`, extra allowed
    values `also`, or a closed set `choices`; `note` says why, in the message."""
    lo: float | None = None
    hi: float | None = None
    above: float | None = None
    below: float | None = None
    also: tuple = ()
    choices: tuple = ()
    note: str = ""

    def ok(self, v) -> bool:
        if self.choices:
            return v in self.choices
        if v in self.also:
            return True
        return ((self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi) and
                (self.above is None or v > self.above) and (self.below is None or v < self.below))

    def describe(self, kind=None, noun: str | None = None) -> str:
        if self.choices:
            text = "one of " + ", ".join(str(c) for c in self.choices)
        else:
            noun = noun or _NOUNS.get(kind, "a value")
            if self.lo is not None and self.hi is not None:
                bounds = [f"between {self.lo} and {self.hi}"]
            else:
                bounds = [f">= {self.lo}" if self.lo is not None else
                          f"> {self.above}" if self.above is not None else "",
                          f"<= {self.hi}" if self.hi is not None else
                          f"< {self.below}" if self.below is not None else ""]
            text = " ".join([noun, " and ".join(b for b in bounds if b)]).strip()
            if self.also:
                text = " or ".join([*(str(a) for a in self.also), text])
        return f"{text} ({self.note})" if self.note else text


# ----------------------------------------------------------------------------- declarations
def ranged(default, *, lo=None, hi=None, above=None, below=None, also=(), note=""):
    """A dataclass field with `default` and a numeric range (see `Rule`)."""
    rule = Rule(lo=lo, hi=hi, above=above, below=below, also=tuple(also), note=note)
    assert rule.ok(default), (default, rule)
    return dataclasses.field(default=default, metadata={_KEY: rule})


def positive(default, note=""):
    """An integer >= 1, or a number > 0 (by the default's type)."""
    if isinstance(default, int):
        return ranged(default, lo=1, note=note)
    return ranged(default, above=0, note=note)


def nonneg(default, note=""):
    """An integer or number >= 0."""
    return ranged(default, lo=0, note=note)


def one_of(default, *choices, note=""):
    """A field whose value is one of `choices` (the default among them)."""
    assert default in choices, (default, choices)
    return dataclasses.field(default=default, metadata={_KEY: Rule(choices=choices, note=note)})


# ----------------------------------------------------------------------------- checking
@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _kind(hint) -> tuple[type | None, bool]:
    """(int | float | str | bool | None, whether None is allowed) of an annotation."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 and args[0] in _NOUNS else None), True
    return (hint if hint in _NOUNS else None), False


def _is(v, kind) -> bool:
    if kind is bool:
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if kind is int:
        return isinstance(v, int)
    if kind is float:
        return isinstance(v, (int, float)) and math.isfinite(v)
    return isinstance(v, kind)


def _problem(f: dataclasses.Field, hint, v) -> str | None:
    """What `v` must be instead, or None if it is valid for field `f`."""
    rule = f.metadata.get(_KEY)
    kind, optional = _kind(hint)
    if v is None and optional:
        return None
    if kind is not None and not _is(v, kind):
        return (rule or Rule()).describe(kind)
    if rule is not None and not rule.ok(v):
        return rule.describe(kind)
    return None


def problems(obj, prefix: str = "") -> list[str]:
    """One message per invalid field of the dataclass `obj` and of the dataclasses it holds, then
    its `relations()`; `prefix` names it (e.g. "data.")."""
    errs = []
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key, v = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            errs += problems(v, key + ".")
            continue
        msg = _problem(f, hints.get(f.name), v)
        if msg:
            errs.append(f"{key}={v!r}: must be {msg}")
    relations = getattr(obj, "relations", None)
    if relations is not None:
        try:
            errs += relations()
        except (ArithmeticError, TypeError, ValueError):
            if not errs:     # otherwise a field it relates is already reported as invalid
                raise
    return errs


def check(cls, name: str, value, key: str, via: str = "") -> str | None:
    """The message for `value` as field `name` of dataclass `cls` (None if valid), named `key`
    (e.g. "train.steps"): command-line shorthands are checked as the field they set, `via` names
    the flag (`train --steps` is `train.steps`)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    msg = _problem(f, _hints(cls).get(name), value)
    return f"{key}={value!r}{f' (from {via})' if via else ''}: must be {msg}" if msg else None


def raise_problems(errs: list[str], what: str = "config") -> None:
    """One ValueError listing every problem (the CLI prints it and exits 2)."""
    if errs:
        raise ValueError(f"invalid {what}:\n  - " + "\n  - ".join(errs))


# ----------------------------------------------------------------------------- arguments
def arg(kind=int, *, parse=None, noun: str | None = None, **rule):
    """An argparse `type=` for a subcommand's own number: `kind` (or `parse(text)`) then the range
    (`Rule` keywords), so a bad value is an argparse error naming the flag (exit 2)."""
    r = Rule(**rule)
    what = r.describe(kind, noun)

    def convert(text: str):
        try:
            v = (parse or kind)(text)
        except (ValueError, argparse.ArgumentTypeError):
            v = None
        if v is None or not _is(v, kind) or not r.ok(v):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be {what}")
        return v
    convert.__name__ = noun or kind.__name__
    return convert


# ----------------------------------------------------------------------------- paths
def dir_problem(path, key: str) -> str | None:
    """Why `path` cannot be (or become) a writable directory, or None. Nothing of `path` is
    created or changed: an existing directory is checked by its permissions and its file
    system's read-only flag; a new one by making (and removing) an empty directory in the
    nearest existing ancestor (`_try_write`), as permissions do not tell there (root passes
    `os.access` everywhere, /proc included)."""
    p = Path(path)
    name = f"{key}={str(path)!r}"
    if p.exists():
        if not p.is_dir():
            return f"{name}: exists and is not a directory"
        if not os.access(p, os.W_OK | os.X_OK) or _read_only(p):
            return f"{name}: the directory is not writable"
        return None
    parent = p.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{name}: cannot be created, {str(parent)!r} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{name}: cannot be created, {str(parent)!r} is not writable"
    why = _try_write(parent)
    if why:
        return f"{name}: cannot be created in {str(parent)!r} ({why}); choose a directory "\
               f"on a writable file system"
    return None


def _read_only(directory: Path) -> bool:
    """Whether `directory` is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _try_write(directory: Path) -> str:
    """'' when a directory can be made (and is removed again) in `directory`, else why not."""
    import tempfile
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jaxscale-probe-", dir=directory))
    except OSError as e:
        return e.strerror or type(e).__name__
    return ""
