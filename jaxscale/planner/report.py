"""Human-readable tables and the stacked-bar figure of per-device memory."""
from __future__ import annotations

from pathlib import Path

from jaxscale.planner.memory import ROWS

COLORS = {"params": "#4c72b0", "master": "#8172b2", "grads": "#dd8452", "optimizer": "#c44e52",
          "activations": "#55a868", "temporaries": "#937860", "batch": "#8c8c8c"}


def nbytes(x: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def format_prediction(pred) -> str:
    s, mem, t, fl = pred.spec, pred.memory, pred.time, pred.flops
    m = s.model
    from jaxscale.plan import unavailable
    lines = [f"plan {s.label()} on {s.n_devices} x {s.device_kind}  "
             f"(model {m.n_layers}L d={m.dim}, batch {s.batch} x seq {s.seq}, micro-batch "
             f"{s.micro_batch:g}, attention {s.attention})",
             *(f"train cannot run this plan yet: {why}" for why in unavailable(s)),
             "", "per-device memory:"]
    for row in ROWS:
        lines.append(f"  {row:<14}{nbytes(getattr(mem, row)):>12}")
    lines.append(f"  {'total':<14}{nbytes(mem.total):>12}   capacity {nbytes(pred.capacity)}: "
                 f"{'fits' if pred.fits else 'DOES NOT FIT'}")
    for k, v in mem.host.items():
        lines.append(f"  host {k:<9}{nbytes(v):>12}")
    for k, v in mem.disk.items():
        lines.append(f"  disk {k:<9}{nbytes(v):>12}")
    ph = mem.phases
    if ph:
        which = {"backward": "backward", "mean": "gradient mean",
                 "update": "optimizer update"}[max(ph, key=ph.get)]
        mean = (f"; gradient mean {nbytes(ph['mean'])} of gradients and the method's buffers"
                if ph.get("mean") else "")
        lines.append(f"  (peak in the {which}: backward {nbytes(ph['backward'])} of gradients, "
                     f"activations and working set{mean}; update {nbytes(ph['update'])} of "
                     f"gradients and the optimizer-moment copies XLA keeps)")
    if mem.in_flight != 1:
        lines.append(f"  (activations of {mem.in_flight:g} micro-batches in flight)")
    lines += ["", "communication per device per step:",
              f"  {'kind':<19}{'axes':<10}{'count':>7}{'bytes':>12}{'wire':>12}{'time':>10}  what"]
    times = {id(c): None for c in pred.collectives}
    from jaxscale.planner.perf import collective_time
    for c in pred.collectives:
        times[id(c)] = collective_time(s, c)
        lines.append(f"  {c.kind:<19}{','.join(c.axes):<10}{c.count:>7}{nbytes(c.bytes):>12}"
                     f"{nbytes(c.wire_bytes):>12}{times[id(c)] * 1e3:>8.2f}ms  {c.what}"
                     + (" [optional]" if c.optional else ""))
    if not pred.collectives:
        lines.append("  (none)")
    lines += ["", f"FLOPs per device per step: {fl.per_device:.4g} matmul "
                  f"(recompute {fl.recompute:.3g}), model {fl.model_per_device:.4g}",
              f"step time {t.total:.4g} s = compute {t.compute:.3g} (matmul {t.matmul:.3g}, "
              f"memory-bound {t.memory_bound:.3g}) + TP/SP/EP comm {t.critical_comm:.3g} + exposed "
              f"DP/FSDP/PP comm {t.exposed_comm:.3g} (of {t.overlapped_comm:.3g}) + bubble "
              f"{t.bubble:.3g} + offload {t.offload:.3g}",
              f"predicted MFU {t.mfu:.1%}, {t.tokens_per_s:,.0f} tokens/s"]
    return "\n".join(lines)


def format_search(result, top: int = 10) -> str:
    acc, rej = result.accepted, result.rejected
    lines = [result.summary() if hasattr(result, "summary") else
             f"{len(acc)} plans fit, {len(rej)} rejected"]
    if getattr(result, "options", None) is not None:
        lines.append(f"searched: {result.options.describe()}")
    w = max([len(p.spec.label()) + 2 for p in acc[:top]] + [52])
    lines += ["", f"  {'#':>3}  {'plan':<{w}}{'memory':>11}{'step s':>10}{'MFU':>7}"]
    from jaxscale.plan import unavailable
    for i, p in enumerate(acc[:top], 1):
        lines.append(f"  {i:>3}  {p.spec.label():<{w}}{nbytes(p.memory.total):>11}"
                     f"{p.time.total:>10.4g}{p.time.mfu:>7.1%}"
                     + ("  (not in train yet)" if unavailable(p.spec) else ""))
    if len(acc) > top:
        lines.append(f"  ... {len(acc) - top} more")
    if rej:
        lines += ["", "rejected, by reason:"]
        for reason, n in result.reasons().items():
            example = next(why for spec, why in rej if why.startswith(reason)
                           or (reason.startswith("does not fit") and why.startswith("needs"))
                           or (reason.startswith("not available") and "not available" in why))
            spec = next(spec for spec, why in rej if why == example)
            lines.append(f"  {n:>6} x {reason}")
            lines.append(f"           e.g. {spec.label()}: {example}")
    return "\n".join(lines)


def plot_memory(preds, path: Path, title: str = "") -> Path:
    """Stacked bars of per-device memory (one bar per plan) with the device capacity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    preds = list(preds)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.1 * len(preds) + 3.5), 4.5))
    scale, unit = (1e9, "GB") if max(p.memory.total for p in preds) >= 1e8 else (2**20, "MiB")
    x = range(len(preds))
    bottom = [0.0] * len(preds)
    for row in ROWS:
        vals = [getattr(p.memory, row) / scale for p in preds]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, label=row, color=COLORS[row], width=0.6)
            bottom = [b + v for b, v in zip(bottom, vals)]
    cap = preds[0].capacity / scale
    if cap < 4 * max(bottom):
        ax.axhline(cap, color="k", ls="--", lw=1, label=f"capacity ({cap:.3g} {unit})")
    ax.set_xticks(list(x))
    ax.set_xticklabels([p.spec.label().replace(" ", "\n") for p in preds], fontsize=7)
    ax.set_ylabel(f"per-device memory ({unit})")
    ax.set_title(title or "predicted per-device memory", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
