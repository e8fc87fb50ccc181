"""The experiments gallery: run the topic experiments, collect each one's key table and figure, and
write a gallery page of them.

`jaxscale experiments run --all` (or named topics: `run 11 14`) runs every `experiments/NN_*.py`
as its own process (`python experiments/NN_x.py --out runs/experiments/NN_x`), each under a time
limit, and keeps for each: exit status, wall time, the claims table it wrote (`results.json`, from
`experiments/_common.Claims`; else the last table it printed) and the first figure it wrote.
A run writes under its `--out` folder only (default `runs/experiments/`): the results accumulate
in `gallery.json` there (running some topics updates their entries and keeps the others), each
figure is copied to `img/`, and `README.md` is rewritten from them. Running is not publishing:
the committed gallery (`experiments/README.md`, `experiments/gallery.json`, `experiments/img/`)
changes only with `--publish`, which merges the run's entries into it the same way.

The command states its CPU budget before it starts (per experiment `BUDGET_S` on `CORES` cores,
the topics' "under three minutes on a laptop CPU", i.e. CORES x BUDGET_S CPU seconds: CPU time,
unlike wall time, does not grow when something else shares the machine), marks each experiment
over budget, and exits non-zero, naming each one, when any experiment fails, times out or
writes no result: a broken experiment is never silently left out of the gallery.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

BUDGET_S = 180          # per experiment on the 2-core CPU machine (TOPICS: "under three minutes")
CORES = 2               # ... so its CPU budget is CORES x BUDGET_S seconds of CPU time
TAIL = 20               # lines of output shown for an experiment that prints no table
LIMIT_S = 4 * BUDGET_S  # wall-clock seconds after which an experiment is killed: a failure

TITLES = {
    1: "Memory basics", 2: "Mixed precision", 3: "Gradient accumulation",
    4: "Activation checkpointing", 5: "Offloading", 6: "Model parallelism (naive vs pipeline)",
    7: "Data parallelism", 8: "ZeRO stages", 9: "FSDP and HSDP", 10: "Collectives and topology",
    11: "Overlapping communication with computation", 12: "Gradient compression",
    13: "Asynchronous training", 14: "Local SGD, SlowMo, DiLoCo", 15: "Pipeline schedules",
    16: "Tensor parallelism", 17: "Sequence and context parallelism",
    18: "Expert parallelism (MoE)", 19: "3D parallelism", 20: "Memory fragmentation",
    21: "Memory monitoring and profiling", 22: "Buffer donation",
    23: "Quantisation, pruning, distillation", 24: "FlashAttention", 25: "Sparse training",
    26: "Framework comparison", 27: "Multi-node networks", 28: "Fault tolerance",
    29: "Memory/communication co-design (plan search)", 30: "Case studies and tuning checklist",
}


DB = "gallery.json"       # in a gallery's folder: every experiment's last result, its source


def load(folder: Path) -> dict[int, dict]:
    """topic -> its last recorded run in the gallery at `folder` (`DB`), empty before the first."""
    path = folder / DB
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.is_file() else {}


def save(folder: Path, entries: dict[int, dict], tree: Path, figures: dict[int, Path]) -> Path:
    """The gallery at `folder`: `entries` merged into its `gallery.json`, the run's figures
    copied to its `img/`, its README rewritten; returns the README's path."""
    db = load(folder)
    db.update(entries)
    folder.mkdir(parents=True, exist_ok=True)
    for t, src in figures.items():
        (folder / "img").mkdir(exist_ok=True)
        shutil.copyfile(src, folder / db[t]["figure"])
    (folder / DB).write_text(json.dumps({f"{k:02d}": v for k, v in sorted(db.items())},
                                        indent=1))
    return write_readme(folder, db, tree)


def root() -> Path:
    """The source tree: the folder holding `experiments/` next to the `jaxscale` package."""
    here = Path(__file__).resolve().parent.parent
    if not (here / "experiments").is_dir():
        raise FileNotFoundError(f"no experiments/ folder beside {here / 'jaxscale'}: run from a "
                                f"source checkout (pip install -e .)")
    return here


def scripts(tree: Path) -> dict[int, Path]:
    """topic number -> its script `experiments/NN_name.py`."""
    out = {}
    for p in sorted((tree / "experiments").glob("[0-9][0-9]_*.py")):
        out[int(p.name[:2])] = p
    return out


def select(names: list[str], found: dict[int, Path]) -> list[int]:
    """Topic numbers from `NN` or script names; an unknown one is an error naming the valid ones."""
    chosen = []
    for n in names:
        key = int(n) if n.isdigit() else next((t for t, p in found.items()
                                               if p.stem == n or p.name == n), None)
        if key not in found:
            raise SystemExit(f"unknown experiment {n!r}; valid: "
                             f"{', '.join(f'{t:02d}' for t in sorted(found))} or their names")
        chosen.append(key)
    return chosen


#: lines that report where the output went, not results
_NOTE = re.compile(r"(wrote |all \d+ claims hold|results in )")


def last_table(text: str) -> str:
    """The last plain-text table in `text` other than the claims (`Claims.finish` prints them,
    and the gallery shows them from results.json): a header, a line of dashes, rows up to a
    blank line, with the title line above it if any; failing that, the output's last lines."""
    lines = text.splitlines()
    tables = []
    for i, line in enumerate(lines):
        if i and re.fullmatch(r"-{3,}[- ]*", line.strip()) and lines[i - 1].strip():
            start = i - 1
            if start and lines[start - 1].strip() and not re.search(r"\S\s{2,}\S",
                                                                     lines[start - 1]):
                start -= 1          # the table's title line
            end = i
            while end < len(lines) and lines[end].strip() and not _NOTE.match(lines[end]):
                end += 1
            tables.append(lines[start:end])
    tables = [t for t in tables if t[0].strip() != "claims"]
    if not tables:
        return "\n".join([ln for ln in lines if ln.strip() and not _NOTE.match(ln)][-TAIL:])
    return "\n".join(tables[-1])


def claims_table(results: dict) -> str:
    """The claims an experiment wrote (`_common.Claims` rows, or [claim, ok] pairs)."""
    rows = []
    for r in results.get("claims") or []:
        if isinstance(r, dict):
            rows.append((r["claim"], r.get("measured", ""), r.get("expected", ""), r["ok"]))
        else:
            rows.append((r[0], "", "", r[-1]))
    if not rows:
        return ""
    if not any(m or e for _, m, e, _ in rows):
        return "| claim | |\n|---|---|\n" + "\n".join(
            f"| {c} | {'ok' if ok else 'FAIL'} |" for c, _, _, ok in rows)
    head = "| claim | measured | expected | |\n|---|---:|---:|---|\n"
    return head + "\n".join(f"| {c} | {m} | {e} | {'ok' if ok else 'FAIL'} |"
                            for c, m, e, ok in rows)


def run_one(topic: int, script: Path, out_root: Path, tree: Path,
            limit_s: float) -> tuple[dict, Path | None]:
    """Run one experiment into `out_root/<its name>`: its gallery entry, and its first figure."""
    out = out_root / script.stem
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0, cpu0 = time.perf_counter(), _child_cpu()
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=os.pathsep.join(
        filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run([sys.executable, str(script), "--out", str(out)], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=limit_s)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        stdout, stderr = ((x or b"").decode(errors="replace") if isinstance(x, bytes) else
                          (x or "") for x in (e.stdout, e.stderr))
    seconds, cpu = time.perf_counter() - t0, _child_cpu() - cpu0
    # the output names its folder by the default's relative path, wherever it was run
    stdout, stderr = (x.replace(str(out), f"runs/experiments/{script.stem}")
                      for x in (stdout, stderr))
    (out / "stdout.txt").write_text(stdout)
    (out / "stderr.txt").write_text(stderr)
    results = {}
    if (out / "results.json").is_file():
        results = json.loads((out / "results.json").read_text())
        results = results if isinstance(results, dict) else {"rows": results}
    # the experiment's own figures (its folder's top level) before its runs' loss plots
    figures = sorted(out.rglob("*.png"), key=lambda p: (p.parent != out, p.stat().st_mtime))
    figure = f"img/{script.stem}.png" if figures else None
    failed = rc != 0 or (not figures and not results)
    return {"topic": topic, "script": f"experiments/{script.name}", "rc": rc,
            "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1),
            "over_budget": cpu > CORES * BUDGET_S,
            "failed": failed, "claims": claims_table(results),
            "table": (out / "table.md").read_text().strip() if (out / "table.md").is_file()
            else last_table(stdout),
            "figure": figure,
            "tail": "" if not failed else "\n".join((stdout + stderr).splitlines()[-TAIL:]),
            "date": time.strftime("%Y-%m-%d"), "machine": machine()}, \
        (figures[0] if figures else None)


def _child_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes: unlike wall time, not
    inflated when something else shares the machine."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def machine() -> str:
    import platform
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"


def slug(t: int) -> str:
    """The anchor a Markdown renderer gives the heading `## NN title`."""
    return re.sub(r"[^a-z0-9 -]", "", f"{t:02d} {TITLES[t]}".lower()).replace(" ", "-")


def write_readme(folder: Path, entries: dict[int, dict], tree: Path) -> Path:
    """`folder/README.md` from the entries, its links to the scripts of `tree/experiments`."""
    found = scripts(tree)
    to_scripts = os.path.relpath(tree / "experiments", folder)

    def link(path: Path) -> str:
        return path.name if to_scripts == "." else f"{to_scripts}/{path.name}"
    total = sum(e["cpu_seconds"] for e in entries.values())
    lines = [
        "# Experiments gallery", "",
        "One experiment per topic, each runnable on a laptop CPU (8 simulated devices). "
        "This page is",
        "written by `jaxscale experiments run --all` (or `run NN ...` for some topics) from the",
        "experiments' own output, under `runs/experiments/`; `--publish` merges the run into the",
        "committed gallery, `experiments/README.md`. It shows the claims each one checks (measured",
        "beside expected) or its",
        f"key table, and its first figure. Per experiment the budget is {BUDGET_S} s on "
        f"{CORES} CPU cores,", f"{CORES * BUDGET_S} CPU seconds; the last runs took "
        f"{total / 60:.0f} CPU minutes in all.", "",
        "| topic | experiment | result | CPU s | wall s |", "|---|---|---|---:|---:|"]
    for t in range(1, 31):
        e = entries.get(t)
        name = f"[{found[t].name}]({link(found[t])})" if t in found else "none yet"
        status = ("not run" if e is None else "FAILED" if e["failed"] else
                  "over budget" if e["over_budget"] else "ok")
        secs = f"{e['cpu_seconds']:.0f} | {e['seconds']:.0f}" if e else " | "
        lines.append(f"| [{t:02d} {TITLES[t]}](#{slug(t)}) | {name} | {status} | {secs} |")
    for t in range(1, 31):
        e = entries.get(t)
        lines += ["", f"## {t:02d} {TITLES[t]}"]
        if e is None:
            lines.append("" if t in found else "\nNo experiment for this topic yet.")
            continue
        lines += ["", f"`python {e['script']}`: {e['cpu_seconds']:.0f} CPU s "
                  f"({e['seconds']:.0f} s wall) on {e['machine']}, {e['date']}"
                  + (" (over budget)" if e["over_budget"] else "")]
        if e["failed"]:
            lines += ["", f"**FAILED** (exit {e['rc']}):", "", "```", e["tail"], "```"]
        if e["table"]:
            lines += ["", e["table"] if e["table"].startswith("|") else
                      "```\n" + e["table"] + "\n```"]
        if e["claims"]:
            lines += ["", e["claims"]]
        if e["figure"]:
            lines += ["", f"![{TITLES[t]}]({e['figure']})"]
    path = folder / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(names: list[str], all_: bool, out: str = "runs/experiments",
        limit_s: float = LIMIT_S, tree: Path | None = None, publish: bool = False) -> int:
    """Run the named (or all) experiments of `tree` (default: this source tree) into `out` and
    update the gallery there (with `publish`, the committed one in `tree/experiments` too);
    1 when one failed (or, with `all_`, a topic has no experiment), else 0."""
    tree = tree or root()
    found = scripts(tree)
    topics = sorted(found) if all_ else select(names, found)
    if not topics:
        raise SystemExit("name experiments to run (e.g. `run 07 12`) or pass --all")
    print(f"running {len(topics)} experiment(s): budget {BUDGET_S} s each on {CORES} CPU cores "
          f"({CORES * BUDGET_S} CPU s), {len(topics) * BUDGET_S / 60:.0f} min in all on an idle "
          f"machine; each is stopped after {limit_s:.0f} s wall", flush=True)
    folder = Path(out).resolve()
    entries, figures = {}, {}
    for i, t in enumerate(topics, 1):
        print(f"[{i}/{len(topics)}] {found[t].name} ...", end=" ", flush=True)
        entries[t], fig = run_one(t, found[t], folder, tree, limit_s)
        if fig is not None:
            figures[t] = fig
        e = entries[t]
        print(("FAILED (exit %s)" % e["rc"]) if e["failed"] else
              f"{e['cpu_seconds']:.0f} CPU s, {e['seconds']:.0f} s wall"
              + (" OVER BUDGET" if e["over_budget"] else ""), flush=True)
        readme = save(folder, {t: e}, tree, {t: fig} if fig is not None else {})
    print(f"gallery: {readme}")
    if publish:
        print(f"published: {save(tree / 'experiments', entries, tree, figures)}")
    missing = [t for t in range(1, 31) if t not in found]
    failed = [found[t].name for t in topics if entries[t]["failed"]]
    over = [found[t].name for t in topics if entries[t]["over_budget"]]
    if over:
        print(f"over the {CORES * BUDGET_S} CPU s budget: {', '.join(over)}")
    if missing:
        print(f"topics without an experiment: {', '.join(f'{t:02d}' for t in missing)}")
    if failed:
        print(f"FAILED: {', '.join(failed)} (their output: {out}/<name>/stdout.txt)")
    return 1 if failed or (all_ and missing) else 0


def list_topics() -> int:
    """The topics, their experiments and their results in the committed gallery."""
    tree = root()
    found = scripts(tree)
    db = load(tree / "experiments")
    for t in range(1, 31):
        e = db.get(t)
        last = "" if e is None else ("FAILED" if e["failed"] else
                                     f"ok, {e['cpu_seconds']:.0f} CPU s")
        print(f"{t:02d}  {TITLES[t]:<46} {found[t].name if t in found else '-':<34} {last}")
    return 0
