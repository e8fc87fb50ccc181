"""Predicted vs compiled: the planner against `jaxscale inspect` for every plan jaxscale trains.

    python experiments/planner_validation.py                 # table, runs/planner_validation/
    python experiments/planner_validation.py --update-docs   # also rewrite docs/planner.md's table
    python experiments/planner_validation.py --only fsdp8    # a subset (substring match)
    python experiments/planner_validation.py --live-set      # also XLA:CPU's heap packing
    python experiments/planner_validation.py --published     # the step time against published
                                                             # runs (no compilation; --update-docs)

Each case compiles the train step of the tiny LLaMA (2 layers, seq 32, batch 8;
`jaxscale.analysis.validation` `tiny_config`) or the small one on the 8 simulated CPU devices, and
compares, per device: argument+output bytes (tolerance 5%), temp bytes (15%), every (collective
kind, mesh axes) of the census in bytes (2%; XLA:CPU's all-reduce + slice for a reduce-scatter and
the LM head's optional backward all-gather are handled by `jaxscale.analysis.validation`, and each
row says so), and matmul FLOPs against the HLO's dot FLOPs (5%). Add a plan: one line in
`jaxscale.analysis.validation.CASES`.

With --published the planner predicts each published training run of
`jaxscale.analysis.validation.PUBLISHED` (Megatron-LM, BLOOM, torchtitan, Llama 3, Megatron-Core
MoE, the H200 measurement) and compares its MFU with the published one (both counted with
`ModelConfig.flops_per_token` over the dense 16-bit peak): a table, `published.json` and
`published.png` (predicted against published MFU, the 15% band) in the output folder.

With --live-set XLA dumps each train step's buffer assignment and live ranges, and each row adds
the live-set peak (the most bytes of temporaries alive at once in the schedule) and XLA's packing
of them (compiled temp / live-set peak), which the planner does not model but for a gradient
stack kept whole until the update.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import cpu_only, pyplot, savefig  # first: 8 simulated devices before jax

cpu_only()
ROOT = Path(__file__).resolve().parent.parent
DUMP = tempfile.mkdtemp(prefix="jaxscale_live_") if "--live-set" in sys.argv else None
if DUMP:        # read when XLA starts, so before the first compilation
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} "
                               "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from jaxscale import planner  # noqa: E402
from jaxscale.analysis import inspect, validation  # noqa: E402
from jaxscale.analysis.validation import CASES, tiny_config  # noqa: E402


def live_peak(prefix: str) -> int:
    """The most bytes of temporaries alive at once: the values of XLA's preallocated temp buffer
    (sizes from the buffer assignment) summed over their live ranges in the schedule."""
    assignment = Path(prefix + "-buffer-assignment.txt").read_text()
    ranges = Path(prefix + "-live-range.txt").read_text().split("BufferLiveRange:")[1]
    temp = [a for a in re.split(r"\nallocation \d+: ", assignment)
            if "preallocated-temp" in a.split("\n")[0]]
    if not temp:
        return 0
    size = {m.group(1) + (m.group(2) or "{}"): int(m.group(3)) for m in re.finditer(
        r"value: <\d+ ([\w.\-]+)(\{[\d,]*\})? @0> \(size=(\d+),offset=\d+\)", temp[0])}
    live = {}
    for m in re.finditer(r"^\s+([\w.\-]+\{[\d,]*\}):(\d+)-(\d+)", ranges, re.M):
        for t in range(int(m.group(2)), int(m.group(3)) + 1):
            live[t] = live.get(t, 0) + size.get(m.group(1), 0)
    return max(live.values(), default=0)


def run(name: str) -> dict:
    cfg = tiny_config(*CASES[name])
    t0 = time.perf_counter()
    rep = inspect.report(cfg)
    cmp = validation.compare(planner.predict(cfg), rep, backend="cpu")
    cmp["case"], cmp["compile_s"] = name, time.perf_counter() - t0
    if DUMP:       # this step's dump: the newest module; then clear the folder for the next
        names = sorted(glob.glob(os.path.join(DUMP, "*train_step*-buffer-assignment.txt")))
        cmp["live_peak"] = live_peak(names[-1][:-len("-buffer-assignment.txt")])
        shutil.rmtree(DUMP)
    return cmp


def markdown(results: list[dict]) -> str:
    live = all("live_peak" in r for r in results)
    head = ("| plan | arg+out | temp (predicted / compiled) | collectives: worst row | FLOPs | ok |"
            + (" XLA packing |" if live else "") + "\n|---|---|---|---|---|---|"
            + ("---|" if live else ""))
    rows = [head]
    for r in results:
        m = {x["what"]: x for x in r["memory"]}
        t = m["temp"]
        worst = max(r["collectives"], key=lambda c: abs((c["ratio"] or 0) - 1), default=None)
        wc = (f"{worst['kind']} {','.join(worst['axes'])} {worst['ratio']:.4f}"
              if worst and worst["ratio"] is not None else ("none" if not worst else "missing"))
        rows.append(f"| {r['case']} | {m['argument+output']['ratio']:.4f} | {t['ratio']:.3f} "
                    f"({t['predicted'] / 2**20:.2f} / {t['compiled'] / 2**20:.2f} MiB) | {wc} | "
                    f"{m['flops']['ratio']:.4f} | {'yes' if r['ok'] else '**no**'} |"
                    + (f" {t['compiled'] / r['live_peak']:.2f} |" if live else ""))
    return "\n".join(rows)


def summary(results: list[dict]) -> str:
    def worst(what):
        vals = [x["ratio"] for r in results for x in r["memory"] if x["what"] == what]
        return max(vals, key=lambda v: abs(v - 1))
    comm = [c["ratio"] for r in results for c in r["collectives"] if c["ratio"] is not None]
    wc = max(comm, key=lambda v: abs(v - 1)) if comm else 1.0
    packing = [x["compiled"] / r["live_peak"] for r in results for x in r["memory"]
               if x["what"] == "temp" and r.get("live_peak")]
    return (f"Worst predicted/compiled over {len(results)} plans: argument+output "
            f"{worst('argument+output'):.4f}, temp {worst('temp'):.3f}, collective bytes "
            f"{wc:.4f}, FLOPs {worst('flops'):.4f}; {sum(r['ok'] for r in results)} of "
            f"{len(results)} inside every tolerance."
            + (f" XLA:CPU packs the temporaries into {min(packing):.2f}-{max(packing):.2f}x "
               f"their live-set peak." if packing else ""))


def published_markdown(rows: list[dict]) -> str:
    """The published runs against the planner: the table, then the runs outside 15% and why,
    then each run's source and the assumptions its source leaves open."""
    lines = ["| # | run | GPUs | layout | published (as stated) | MFU published | MFU predicted "
             "| predicted / published |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        mark = "" if r["inside"] else (" (outside)" if r["outside"] else " **(outside!)**")
        lines.append(f"| {i} | {r['name']} | {r['gpus']:,} {r['hardware']} | {r['layout']} | "
                     f"{r['stated']} | {r['published_mfu']:.1%} | {r['predicted_mfu']:.1%} | "
                     f"{r['ratio']:.2f}{mark} |")
    inside = sum(r["inside"] for r in rows)
    lines += ["", f"{inside} of {len(rows)} runs within 15% of the published MFU. Outside, and "
              "why:", ""]
    lines += [f"- {i}. {r['name']} ({r['ratio']:.2f}): {r['outside'] or 'NOT EXPLAINED'}."
              for i, r in enumerate(rows, 1) if not r["inside"]]
    lines += ["", "Sources, and what they leave open (the planner's assumption):", ""]
    lines += [f"- {i}. {r['source']}" + (f"; {r['note']}" if r["note"] else "") + "."
              for i, r in enumerate(rows, 1)]
    return "\n".join(lines)


def published_figure(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    top = max(max(r["published_mfu"], r["predicted_mfu"]) for r in rows) * 1.1
    xs = [0, top]
    ax.plot(xs, xs, color="k", lw=1)
    ax.fill_between(xs, [0.85 * x for x in xs], [1.15 * x for x in xs], color="0.85",
                    label="within 15%")
    for i, r in enumerate(rows, 1):
        color = {"a100": "tab:green", "a100-opa": "tab:green"}.get(r["hardware"], "tab:blue")
        ax.scatter(r["published_mfu"], r["predicted_mfu"], color=color,
                   marker="o" if r["inside"] else "x")
        ax.annotate(str(i), (r["published_mfu"], r["predicted_mfu"]), fontsize=8,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("published MFU (green: A100, blue: H100/H200)")
    ax.set_ylabel("planner's MFU")
    ax.set_title("Step time against published runs (x: outside 15%)")
    ax.legend(loc="upper left")
    savefig(fig, path)


def run_published(args) -> int:
    rows = validation.published_rows()
    table = published_markdown(rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "published.md").write_text(table + "\n")
    (out / "published.json").write_text(json.dumps(rows, indent=2) + "\n")
    published_figure(rows, out / "published.png")
    if args.update_docs:
        update_docs(table, ROOT / "docs" / "planner.md", "published")
        shutil.copy(out / "published.png", ROOT / "docs" / "img" / "planner_published.png")
    return 0 if all(r["inside"] or r["outside"] for r in rows) else 1


def update_docs(table: str, path: Path, marker: str = "validation") -> None:
    text = path.read_text()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{path} lacks the {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    path.write_text(head + begin + "\n" + table + "\n" + end + rest.split(end, 1)[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    ap.add_argument("--update-docs", action="store_true", help="rewrite docs/planner.md's table")
    ap.add_argument("--out", default=str(ROOT / "runs" / "planner_validation"))
    ap.add_argument("-v", "--verbose", action="store_true", help="print every row of every case")
    ap.add_argument("--live-set", action="store_true",
                    help="also XLA's packing: compiled temp / the live-set peak of its schedule")
    ap.add_argument("--published", action="store_true",
                    help="the step time against published training runs (no compilation)")
    args = ap.parse_args(argv)
    if args.published:
        return run_published(args)
    names = [n for n in CASES if not args.only or args.only in n]
    results = []
    for name in names:
        r = run(name)
        results.append(r)
        print(validation.format_comparison(r) if args.verbose or not r["ok"] else
              f"{name}: ok ({r['compile_s']:.1f} s)", flush=True)
    table = markdown(results) + "\n\n" + summary(results)
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    if args.update_docs:
        update_docs(table, ROOT / "docs" / "planner.md")
    if DUMP:
        shutil.rmtree(DUMP, ignore_errors=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
