"""Draw docs/img/architecture.png from the code: the layers of `pyproject.toml`'s layers contract,
the modules in each, the imports between them (read from the source, as `tests/test_layout.py`
reads them), and the path of one option from the command line to the compiled step
(`python docs/architecture.py`)."""
from __future__ import annotations

import sys
import textwrap
from collections import Counter
from pathlib import Path

import matplotlib
import tomllib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.test_layout import build_graph  # noqa: E402

#: `--set plan.qat=fp8` from the command line to the compiled step: (file, what it does there)
PATH = [
    ("cli.py", "jaxscale train llama_tiny --set plan.qat=fp8"),
    ("config.py", "PlanConfig.qat: one_of(none, int8, fp8)"),
    ("plan.py", "Spec; STRATEGIES: problems, rules, collectives,\n"
     "memory, step_parts, in one order"),
    ("strategies/qat/__init__.py", "problems; rules: the projection seam;\n"
     "shape_step: state.quant + a probe"),
    ("train/setup.py, train/step.py", "the step built from StepParts\n(names no strategy)"),
    ("hooks/projection.py", "the model's matmuls call project():\nqat's registered fp8 matmul"),
    ("strategies/qat/numerics.py", "e4m3 x e4m3 dot, e5m2 gradients,\n"
     "amaxes as the scales' cotangent"),
]


def layers() -> list[list[str]]:
    contract = next(c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())
                    ["tool"]["importlinter"]["contracts"] if c["id"] == "layers")
    return [[m.strip() for m in layer.replace(":", "|").split("|")]
            for layer in contract["layers"]]


def layer_of(module: str, rows: list[list[str]]) -> int | None:
    for i, row in enumerate(rows):
        if any(module == m or module.startswith(m + ".") for m in row):
            return i
    return None


def main() -> None:
    rows = layers()
    graph = build_graph()
    count = Counter()
    for m in graph.modules:
        i = layer_of(m, rows)
        if i is not None:
            top = next(p for p in rows[i] if m == p or m.startswith(p + "."))
            count[top] += 1
    edges = Counter()
    children: dict[str, list[str]] = {}
    for m in sorted(graph.modules):
        a = layer_of(m, rows)
        if a is not None:
            top = next(p for p in rows[a] if m == p or m.startswith(p + "."))
            rest = m.removeprefix(top + ".").split(".")
            folder = ROOT / "jaxscale" / Path(*top.split(".")[1:]) / rest[0]
            name = rest[0] + ("/" if folder.is_dir() else "")
            if m != top and name not in children.setdefault(top, []):
                children[top].append(name)
        for n in graph.find_modules_directly_imported_by(m):
            b = layer_of(n, rows)
            if a is not None and b is not None and a != b:
                edges[(a, b)] += 1
    fig, ax = plt.subplots(figsize=(14, 12))
    h, gap, w = 0.72, 0.14, 6.2
    y0 = len(rows) * (h + gap)
    ys = {}
    for i, row in enumerate(rows):
        y = y0 - i * (h + gap)
        ys[i] = y
        ax.add_patch(FancyBboxPatch((0.3, y), w, h, boxstyle="round,pad=0.03",
                                    fc="#e3f1e3" if "jaxscale.strategies" in row else "#e8eef7",
                                    ec="#444444", lw=1))
        names = "   ".join(f"{p.removeprefix('jaxscale.')} ({count[p]})" for p in row)
        ax.text(0.45, y + h - 0.2, names, fontsize=8.6, va="center", family="monospace",
                weight="bold")
        inside = "; ".join((f"{p.removeprefix('jaxscale.')}: " if len(row) > 1 else "")
                           + " ".join(children[p]) for p in row if children.get(p))
        ax.text(0.45, y + h - 0.36, "\n".join(textwrap.wrap(inside, 100)), fontsize=6.6,
                va="top", family="monospace")
    for a in range(len(rows) - 1):
        n = sum(k for (i, j), k in edges.items() if i <= a < j)
        x = 6.65
        ax.add_patch(FancyArrowPatch((x, ys[a] + 0.05), (x, ys[a + 1] + h - 0.02),
                                     arrowstyle="-|>", mutation_scale=10, lw=1, color="#333333"))
        ax.text(x + 0.08, (ys[a] + ys[a + 1] + h) / 2, f"{n}", fontsize=7, va="center")
    down = sum(n for (a, b), n in edges.items() if b > a)
    up = sum(n for (a, b), n in edges.items() if b < a)
    ax.text(0.3, y0 + h + 0.25, f"the layers (modules in each); an arrow: the imports that cross "
            f"it ({down} point down, {up} up)", fontsize=9.5, weight="bold")
    # the path of one option
    x, y = 7.6, y0 + h
    ax.text(x, y + 0.25, "--set plan.qat=fp8, file by file", fontsize=9.5, weight="bold")
    step = (y0 + h - 0.2) / len(PATH)
    for k, (where, what) in enumerate(PATH):
        yy = y - (k + 1) * step + 0.25
        ax.add_patch(FancyBboxPatch((x, yy), 5.2, step * 0.72, boxstyle="round,pad=0.03",
                                    fc="#fdf2d0", ec="#444444", lw=1))
        ax.text(x + 0.12, yy + step * 0.72 - 0.08, where, fontsize=8.5, weight="bold", va="top")
        ax.text(x + 0.12, yy + step * 0.72 - 0.36, what, fontsize=7.8, va="top",
                family="monospace")
        if k:
            ax.add_patch(FancyArrowPatch((x + 2.6, yy + step * 0.72 + step * 0.28),
                                         (x + 2.6, yy + step * 0.72), arrowstyle="-|>",
                                         mutation_scale=9, lw=1, color="#333333"))
    ax.set_xlim(0, 13)
    ax.set_ylim(-0.2, y0 + h + 0.6)
    ax.axis("off")
    out = ROOT / "docs" / "img" / "architecture.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
