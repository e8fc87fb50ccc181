"""python experiments/20_fragmentation.py [--out runs/exp20]

Topic 20: memory fragmentation, and why XLA mostly avoids it.

Part 1, XLA's static buffer assignment. XLA plans every temporary of a compiled program ahead of
time and packs values whose live ranges do not overlap into the same bytes of one temp buffer.
For a few train steps (tiny model, dp=8) this compares the compiled `temp` bytes with the sum of
all the buffers the program's instructions produce, read from `compiled.as_text()` (the result
shape of every instruction outside fusion bodies, less those that allocate nothing: parameters,
constants, tuples, get-tuple-element, bitcasts, control flow): once per instruction, and times
the trip count of the loop it sits in (what allocating every value fresh would touch).

Part 2, a caching allocator (`jaxscale/analysis/allocator.py`, modelled on PyTorch's: 512-byte
rounding, small/large pools, best fit, block splitting, coalescing on free, segments cached)
replays three allocation patterns: uniform random sizes, per-step tensors that follow a growing
sequence length, and transformer training steps with varying sequence length. For segment
granularities ("block size") from 64 KiB to 32 MiB it reports fragmentation = 1 - live/reserved
at the moment reserved memory peaks, and the number of device allocations (each a cudaMalloc
on a GPU; a platform allocator without a cache would make one per request).
Writes fragmentation.png.
"""
from __future__ import annotations

import re
import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

from jaxscale.analysis import allocator as sim  # noqa: E402
from jaxscale.analysis import hlo, inspect  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

NO_BUFFER = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple", "while",
             "conditional", "call", "after-all", "opt-barrier", "partition-id", "replica-id"}
CONFIGS = {"tiny L=2": ("model.n_layers=2",), "tiny L=4": ("model.n_layers=4",),
           "tiny L=4, remat full": ("model.n_layers=4", "plan.remat=full")}
BLOCKS = (64 * sim.KiB, 512 * sim.KiB, 2 * sim.MiB, 8 * sim.MiB, 32 * sim.MiB)


def buffer_sums(text: str) -> tuple[float, float]:
    """(bytes of all instruction results once, and times loop trip counts)."""
    mod = hlo.Module(text)
    fused = set(re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", text))
    once = trips = 0.0
    for ins in mod.instrs:
        if ins.computation in fused or ins.opcode in NO_BUFFER:
            continue
        b = hlo.nbytes(hlo.shapes(ins.type_str))
        once += b
        trips += b * mod.runs[ins.computation]
    return once, trips


def main():
    args = C.parse_args(__doc__, "runs/exp20")
    t0 = time.time()
    claims = C.Claims()
    xla = {}
    for name, over in CONFIGS.items():
        exe = build(C.config(*C.DP8, *over, seq=128, batch=16)).lower_train_step().compile()
        once, trips = buffer_sums(exe.as_text())
        xla[name] = {"temp": inspect.memory(exe)["temp"], "once": once, "trips": trips}
        claims.check(f"{name}: temp / sum of instruction buffers", xla[name]["temp"] / once,
                     "< 0.5", xla[name]["temp"] < 0.5 * once)
    print(C.table(["train step", "sum of buffers MiB", "x loop trips MiB", "compiled temp MiB",
                   "temp / sum", "temp / (x trips)"],
                  [[n, f"{r['once'] / C.MiB:.1f}", f"{r['trips'] / C.MiB:.1f}",
                    f"{r['temp'] / C.MiB:.1f}", f"{r['temp'] / r['once']:.3f}",
                    f"{r['temp'] / r['trips']:.3f}"] for n, r in xla.items()],
                  title="XLA buffer reuse (per device, dp=8, batch 16 x 128)"))

    patterns = {"uniform": sim.uniform(), "growing seq": sim.growing(),
                "transformer": sim.transformer()}
    res = {p: {b: sim.replay(ev, block_size=b) for b in BLOCKS} for p, ev in patterns.items()}
    rows = []
    for p, by in res.items():
        n_alloc = sum(1 for e in patterns[p] if e[0] == "alloc")
        for b, r in by.items():
            rows.append([p, f"{b // sim.KiB:,} KiB", f"{r['peak_live'] / C.MiB:.1f}",
                         f"{r['peak_reserved'] / C.MiB:.1f}", f"{r['fragmentation_at_peak']:.3f}",
                         f"{r['device_allocs']} / {n_alloc}"])
        claims.check(f"{p}: reserved - live at the peaks, smallest over block sizes (MiB)",
                     min(r["peak_reserved"] - r["peak_live"] for r in by.values()) / C.MiB,
                     ">= 0",
                     all(r["peak_reserved"] >= r["peak_live"] for r in by.values()))
    print()
    print(C.table(["pattern", "block size", "peak live MiB", "peak reserved MiB",
                   "fragmentation", "device allocs / requests"], rows,
                  title="caching-allocator simulator: fragmentation = 1 - live/reserved at the "
                        "reserved peak"))
    frag = lambda p, b: res[p][b]["fragmentation_at_peak"]
    two = 2 * sim.MiB
    u = res["uniform"][two]
    claims.check("uniform: everything freed at the end (live, allocated bytes)",
                 f"{u['final_live']}, {u['final_allocated']}", "0, 0",
                 u["final_live"] == 0 and u["final_allocated"] == 0)
    claims.check("growing sequences fragment more than uniform sizes (2 MiB blocks)",
                 f"{frag('growing seq', two):.3f} vs {frag('uniform', two):.3f}", "greater",
                 frag("growing seq", two) > frag("uniform", two))
    claims.check("growing sequences: larger blocks fragment less (64 KiB vs 32 MiB)",
                 f"{frag('growing seq', BLOCKS[0]):.3f} vs {frag('growing seq', BLOCKS[-1]):.3f}",
                 "decreasing", frag("growing seq", BLOCKS[0]) > frag("growing seq", BLOCKS[-1]))
    claims.check("transformer steps: larger blocks fragment more (64 KiB vs 32 MiB)",
                 f"{frag('transformer', BLOCKS[0]):.3f} vs {frag('transformer', BLOCKS[-1]):.3f}",
                 "increasing", frag("transformer", BLOCKS[0]) < frag("transformer", BLOCKS[-1]))
    ratio = u["device_allocs"] / sum(1 for e in patterns["uniform"] if e[0] == "alloc")
    claims.check("caching: device allocations per request (uniform, 2 MiB)", ratio, "< 0.05",
                 ratio < 0.05)

    plt = C.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(xla)
    x = range(len(names))
    a1.bar([i - 0.27 for i in x], [xla[n]["trips"] / C.MiB for n in names], 0.27,
           label="all buffers x loop trips")
    a1.bar(list(x), [xla[n]["once"] / C.MiB for n in names], 0.27, label="all buffers, once")
    a1.bar([i + 0.27 for i in x], [xla[n]["temp"] / C.MiB for n in names], 0.27,
           label="compiled temp")
    a1.set_xticks(list(x), names, fontsize=8)
    a1.set_ylabel("MiB per device")
    a1.set_title("XLA packs values with disjoint lifetimes")
    a1.legend(fontsize=8)
    for p in res:
        a2.plot([b / sim.MiB for b in BLOCKS], [frag(p, b) for b in BLOCKS], "o-", label=p)
    a2.set_xscale("log", base=2)
    a2.set_xlabel("segment granularity (block size), MiB")
    a2.set_ylabel("fragmentation = 1 - live/reserved at peak")
    a2.set_title("caching allocator simulator")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3, which="both")
    C.save(fig, args.out, "fragmentation.png")
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {"xla": xla, "simulator": {p: {str(b): r for b, r in by.items()}
                                                       for p, by in res.items()}})


if __name__ == "__main__":
    main()
