"""The composition table: every pair of the plan options users combine, validated as `train`
validates them.

`OPTIONS` are 28 options, each a few `--set` overrides on 8 devices (a mesh degree of 2 where
it names one; dp takes the devices left). `pair(a, b)` validates the two together
(`plan.validate`: the plan's problems and what `train` cannot run) and returns the refusal, if
any; `table()` does it for all 378 pairs. A refusal that remains must be one no implementation
could run: `REASONS` names each by the words of its message, with why, and `docs/composition.md`
(written by `python -m jaxscale.analysis.composition --update-docs`) shows the table.
`PENDING` lists the refusals an implementation could avoid that are not built yet.
`tests/test_composition.py` checks that every other refusal is one of `REASONS`, that `PENDING`
is exactly what is still refused, and that the committed page is the table the code gives.
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

#: name -> (mesh degrees, other overrides)
OPTIONS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "fsdp": ({"fsdp": 2}, ()),
    "ZeRO-1": ({}, ("plan.zero=1",)),
    "ZeRO-3": ({}, ("plan.zero=3",)),
    "tp": ({"tp": 2}, ()),
    "Megatron SP": ({"tp": 2}, ("plan.sequence_parallel=true",)),
    "ring": ({"sp": 2}, ("plan.context=ring",)),
    "Ulysses": ({"sp": 2}, ("plan.context=ulysses",)),
    "MoE": ({}, ("model.moe_experts=4",)),
    "ep": ({"ep": 2}, ("model.moe_experts=4",)),
    "pp 1F1B": ({"pp": 2}, ("plan.schedule=1f1b", "plan.accumulate=2")),
    "pp ZB-H1": ({"pp": 2}, ("plan.schedule=zb-h1", "plan.accumulate=2")),
    "pp interleaved": ({"pp": 2}, ("plan.schedule=interleaved", "plan.virtual_stages=2",
                                   "plan.accumulate=2")),
    "pp ZB-V": ({"pp": 2}, ("plan.schedule=zb-v", "plan.accumulate=4")),
    "accumulation": ({}, ("plan.accumulate=2",)),
    "full remat": ({}, ("plan.remat=full",)),
    "optimizer offload": ({}, ("plan.offload=optimizer",)),
    "bf16": ({}, ("plan.precision=bf16",)),
    "fp16": ({}, ("plan.precision=fp16",)),
    "int8 compression": ({}, ("plan.compression=int8",)),
    "PowerSGD": ({}, ("plan.compression=powersgd", "plan.compression_rank=2")),
    "DiLoCo": ({}, ("plan.local_sgd=diloco", "plan.local_steps=4")),
    "Streaming DiLoCo": ({}, ("plan.local_sgd=diloco", "plan.local_steps=4",
                              "plan.outer_fragments=2", "plan.outer_delay=1")),
    "QAT fp8": ({}, ("plan.qat=fp8",)),
    "QAT int8": ({}, ("plan.qat=int8",)),
    "2:4 pruning": ({}, ("plan.prune=2:4",)),
    "sparse embedding": ({}, ("plan.sparse_embedding=true",)),
    "collective matmul": ({"tp": 2}, ("plan.sequence_parallel=true",
                                      "plan.tp_overlap=collective_matmul")),
    "ZeRO++ qwZ+qgZ": ({"fsdp": 2}, ("plan.zeropp=qwz+qgz",)),
}
#: the options the pipeline and mixture-of-experts issues own
PIPELINE = ("pp 1F1B", "pp ZB-H1", "pp interleaved", "pp ZB-V")
EXPERTS = ("MoE", "ep")
#: the tiny model every pair runs on: 4 layers (2 pipeline stages x 2 virtual stages), 16
#: sequences of 32 tokens (up to 4 micro-batches over a data degree up to 4)
BASE = ("model.n_layers=4", "model.n_kv_heads=8", "data.batch_size=16", "data.seq_len=32",
        "plan.check_memory=false")
#: the refusals that remain: words of the message -> why no implementation could run the pair
REASONS: dict[str, str] = {
    "has no gradient mean to replace":
        "local SGD averages parameters every H steps; a step of it has no gradient mean for "
        "the sparse exchange to replace",
    "would split one optimizer state over those ranks":
        "each dp rank trains its own replica with its own optimizer state; ZeRO shards one "
        "state over the dp ranks, which no longer share one (fsdp shards each replica instead)",
}

#: refused pairs that an implementation could run and that are not built yet: (a, b) -> what
#: it takes. `tests/test_composition.py` holds this list to what validation refuses, so it
#: shrinks as they are built and cannot grow unnoticed.
PENDING: dict[tuple[str, str], str] = {}


def overrides(*names: str) -> tuple[str, ...]:
    """The `--set` strings of options `names` together on 8 devices (dp takes what is left)."""
    degrees: dict[str, int] = {}
    rest: list[str] = []
    for name in names:
        deg, extra = OPTIONS[name]
        for axis, d in deg.items():
            degrees[axis] = max(degrees.get(axis, 1), d)
        for o in extra:        # a micro-batch count: the larger of two options' (both need it)
            key, _, val = o.partition("=")
            same = next((i for i, r in enumerate(rest) if r.startswith(key + "=")), None)
            if key == "plan.accumulate" and same is not None:
                rest[same] = f"{key}={max(int(val), int(rest[same].partition('=')[2]))}"
            elif o not in rest:
                rest.append(o)
    used = 1
    for d in degrees.values():
        used *= d
    mesh = {"dp": 8 // used, "pp": 1, "fsdp": 1, "ep": 1, "sp": 1, "tp": 1, **degrees}
    return BASE + tuple(f"mesh.{a}={d}" for a, d in mesh.items()) + tuple(rest)


def pair(a: str, b: str) -> str:
    """'' when `train` accepts options a and b together, else its message."""
    from jaxscale import plan
    from jaxscale.analysis.validation import tiny_config
    try:
        plan.validate(tiny_config(*overrides(a, b)), 8)
    except ValueError as e:
        return str(e)
    return ""


def reason(message: str) -> str | None:
    """The entry of `REASONS` a refusal's message names, or None (a refusal to remove)."""
    return next((k for k in REASONS if k in message), None)


def table() -> dict[tuple[str, str], str]:
    """Every pair of `OPTIONS` -> '' (accepted) or the refusal's message."""
    return {(a, b): pair(a, b) for a, b in itertools.combinations(OPTIONS, 2)}


def owner(a: str, b: str) -> str:
    if a in PIPELINE or b in PIPELINE:
        return "pipeline"
    if a in EXPERTS or b in EXPERTS:
        return "experts"
    return "data and layout"


def markdown(results: dict[tuple[str, str], str]) -> str:
    names = list(OPTIONS)
    short = {n: str(i + 1) for i, n in enumerate(names)}
    accepted = sum(1 for m in results.values() if not m)
    lines = ["# Composition: every pair of plan options", "",
             "Generated by `python -m jaxscale.analysis.composition --update-docs` from "
             "`jaxscale/analysis/composition.py` (checked by `tests/test_composition.py`): each "
             f"of the {len(names)} options below is a few `--set` overrides on 8 devices, and "
             "each pair is validated as `jaxscale train` validates a plan.", "",
             f"**{accepted} of {len(results)} pairs are accepted.** A refusal is either one "
             "no implementation could run (a letter: the reasons are listed below the table) "
             "or one still to be built (`?`, listed last).", "",
             "| # | option | overrides |", "|---|---|---|"]
    for n in names:
        deg, extra = OPTIONS[n]
        sets = [f"mesh.{a}={d}" for a, d in deg.items()] + list(extra)
        lines.append(f"| {short[n]} | {n} | `{' '.join(sets)}` |")
    lines += ["", "Pairs (`ok`: accepted; a letter: refused, for the reason of that letter):", "",
              "| | " + " | ".join(short[n] for n in names) + " |",
              "|---" * (len(names) + 1) + "|"]
    letters = {k: chr(ord("a") + i) for i, k in enumerate(REASONS)}
    for a in names:
        row = []
        for b in names:
            if a == b:
                row.append("")
                continue
            msg = results.get((a, b), results.get((b, a), ""))
            row.append("ok" if not msg else letters.get(reason(msg), "?"))
        lines.append(f"| {short[a]} | " + " | ".join(row) + " |")
    lines += ["", "Why the refusals remain:", ""]
    for k, why in REASONS.items():
        lines.append(f"- **{letters[k]}** ({k}): {why}.")
    pending = [(a, b) for (a, b), m in results.items() if m and (a, b) in PENDING]
    if pending:
        lines += ["", "Refused, to be built (`?` above):", ""]
        lines += [f"- {a} + {b}: {PENDING[(a, b)]}" for a, b in pending]
    unexplained = [(a, b, m) for (a, b), m in results.items()
                   if m and reason(m) is None and (a, b) not in PENDING]
    if unexplained:
        lines += ["", "Refused, not yet explained:", ""]
        for a, b, m in unexplained:
            first = m.splitlines()[1].strip("- ") if "\n" in m else m
            lines.append(f"- {a} + {b}: {first}")
    return "\n".join(lines) + "\n"


DOC = Path(__file__).resolve().parents[2] / "docs" / "composition.md"
#: where the pair table ends in `DOC` and the generated layouts' section begins
SWEEP_MARK = "\n## Generated layouts\n"


def table_part(text: str) -> str:
    """The pair table of `DOC`'s text (what `markdown(table())` writes)."""
    return text.partition(SWEEP_MARK)[0].rstrip("\n") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update-docs", action="store_true", help=f"write {DOC}")
    args = ap.parse_args(argv)
    text = markdown(table())
    if args.update_docs:             # the generated layouts' section (`sweep`) is kept
        kept = DOC.read_text().partition(SWEEP_MARK)
        DOC.write_text(text + (kept[1] + kept[2] if kept[1] else ""))
        print(f"wrote {DOC}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
