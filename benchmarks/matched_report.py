"""Tables and the figure of `benchmarks/matched_training.py`: tokens/s ratio, memory per rank,
losses, and the collectives each side issues per step."""
from __future__ import annotations

from pathlib import Path

MiB = 2**20

def format_table(results: list[dict]) -> str:
    head = (f"{'pair':<34}{'world':>6}{'tok/s JAX':>11}{'tok/s torch':>12}{'JAX/torch':>10}"
            f"{'state MiB/rank':>17}{'peak MiB/rank':>16}{'loss@N JAX':>12}{'torch':>10}"
            f"{'max|dloss|':>12}")
    lines = [head, "-" * len(head)]
    for r in results:
        j, t = r["jax"], r["torch"]
        lines.append(
            f"{r['jax_name'] + ' vs ' + r['torch_name']:<34}{r['world']:>6}"
            f"{j['tokens_per_s']:>11,.0f}{t['tokens_per_s']:>12,.0f}"
            f"{r['ratio_tokens_per_s']:>10.2f}"
            f"{j['state_bytes_per_device'] / MiB:>8.2f} |"
            f"{max(t['state_bytes_per_rank']) / MiB:>6.2f}"
            f"{j['peak_bytes_per_device'] / MiB:>8.1f} |{max(t['peak_bytes_per_rank']) / MiB:>6.1f}"
            f"{j['loss'][-1]:>12.5f}{t['loss'][-1]:>10.5f}{max(r['loss_abs_diff']):>12.2e}")
    lines.append("state: params + Adam moments per rank (JAX | torch); peak: JAX compiled "
                 "memory_analysis per device | torch " + (results[0]["torch"]["peak_kind"]
                                                          if results else ""))
    return "\n".join(lines)


def format_collectives(results: list[dict]) -> str:
    """Collectives per step: the jaxscale census (kind[axes] x count, bytes per device) beside the
    torch ops one step issued (torch's CommDebugMode, counted on rank 0; the gradient-norm
    all-reduce of sharded gradients and the loss/counter scalars included on both sides)."""
    lines = [f"{'pair':<11}{'jaxscale (XLA census)':<56}torch (CommDebugMode)"]
    for r in results:
        jax_c = [f"{c['kind']}[{','.join(c['axes'])}] x{c['count']} {c['bytes'] / MiB:.2f}MiB"
                 for c in r["jax"]["census"]] or ["(none)"]
        torch_c = [f"{k.split('.')[-1].rstrip('_')} x{v}" for k, v in
                   sorted(r["torch"]["collectives"].items())] or ["(none)"]
        for i in range(max(len(jax_c), len(torch_c))):
            lines.append(f"{r['pair'] if i == 0 else '':<11}"
                         f"{jax_c[i] if i < len(jax_c) else '':<56}"
                         f"{torch_c[i] if i < len(torch_c) else ''}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(17, 4.5))
    for c, r in enumerate(results):
        steps = range(1, len(r["jax"]["loss"]) + 1)
        ax0.plot(steps, r["jax"]["loss"], "-", color=f"C{c}", label=r["jax_name"])
        ax0.plot(steps, r["torch"]["loss"], "--", color=f"C{c}", label=r["torch_name"])
        ax1.semilogy(steps, [max(d, 1e-9) for d in r["loss_abs_diff"]], "-o", ms=3,
                     color=f"C{c}", label=r["pair"])
    ax0.set(xlabel="step", ylabel="train loss (nats/token)", title="same init, data, optimizer")
    ax0.legend(fontsize=7)
    ax1.set(xlabel="step", ylabel="|loss JAX - loss torch|", title="agreement (fp32)")
    ax1.legend(fontsize=7)
    names = [f"{r['pair']}\n({r['world']} ranks)" for r in results]
    ax2.bar(names, [r["ratio_tokens_per_s"] for r in results],
            color=[f"C{c}" for c in range(len(results))])
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set(ylabel="tokens/s JAX / torch",
            title=f"throughput ratio ({results[0]['backend'] if results else ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
