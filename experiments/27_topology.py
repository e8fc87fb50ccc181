"""python experiments/27_topology.py [--out runs/exp27] [--nodes 16] [--gpus 8]

Topic 27: multi-node networks, and which all-reduce each favours (`jaxscale/comm/topology.py`, a
model, no devices; about a second).

A cluster of nodes x 8 H100 (NVLink 370 GB/s per GPU inside, one 400 Gb/s NIC per GPU outside)
wired as a fat tree (non-blocking, and 4:1 oversubscribed above the leaves), a rail-optimised
network (GPU i of every node on rail switch i; 2:1 above the rails) and a dragonfly (groups of
4 nodes, 200 GB/s between two groups). For message sizes from 64 KiB to 4 GiB it predicts a flat
ring over all GPUs, a (single-channel) double binary tree and the two-level hierarchical
all-reduce (NVLink ring inside, one ring per rail across nodes), and the bytes each GPU sends
over the network. Claims: the hierarchical all-reduce beats the flat ring wherever the network
is slower than NVLink, though both send about as many bytes across nodes per GPU: the flat ring
pushes its whole stream through one NIC at each node boundary, the hierarchical one spreads it
over all 8 NICs of a node (one ring per rail);
the tree wins small messages (2 log2 N latency steps instead of 2 (N-1)); oversubscription above
the rails slows the flat ring (its node-boundary hops change rail) but not the hierarchical
all-reduce (its network flows stay on one rail). Writes topology.png.
"""
from __future__ import annotations

import _common as C

import numpy as np

from jaxscale.comm import topology as T

SIZES = [2 ** k for k in range(16, 33, 2)]          # 64 KiB .. 4 GiB


def main() -> None:
    def extra(ap):
        ap.add_argument("--nodes", type=int, default=16)
        ap.add_argument("--gpus", type=int, default=8)
    args = C.parse_args(__doc__, "runs/exp27", extra)
    claims = C.Claims()
    b, a = args.nodes, args.gpus
    topos = {"fat-tree 1:1": T.FatTree(b, a), "fat-tree 4:1": T.FatTree(b, a, oversubscription=4),
             "rail 1:1": T.RailOptimized(b, a), "rail 2:1": T.RailOptimized(b, a,
                                                                          oversubscription=2),
             "dragonfly": T.Dragonfly(b, a)}
    times = {(name, alg): [T.all_reduce_time(t, alg, s) for s in SIZES]
             for name, t in topos.items() for alg in T.ALGORITHMS}
    rows = []
    for name, t in topos.items():
        for i, s in enumerate(SIZES):
            if s in (2 ** 16, 2 ** 24, 2 ** 30, 2 ** 32):
                best = T.best(t, s)[0][0]
                rows.append([name, f"{s / 2**20:g} MiB",
                             *[f"{times[name, alg][i] * 1e3:.3f}" for alg in T.ALGORITHMS], best])
    print(C.table(["network", "size", *[f"{alg} ms" for alg in T.ALGORITHMS], "fastest"], rows,
                  title=f"all-reduce on {b} nodes x {a} GPUs (model)"))
    S = 2 ** 30
    net = [[alg, T.network_bytes(topos["rail 1:1"], alg, S) / 2**20] for alg in T.ALGORITHMS]
    print()
    print(C.table(["algorithm", "MiB per GPU over the network (1 GiB all-reduce)"], net))

    for name, t in topos.items():
        ratio = times[name, "flat_ring"][-1] / times[name, "hierarchical"][-1]
        claims.check(f"{name}: hierarchical beats the flat ring at 4 GiB", f"{ratio:.2f}x",
                     "> 1x", ratio > 1)
        claims.check(f"{name}: the tree is fastest at 64 KiB", T.best(t, SIZES[0])[0][0], "tree",
                     T.best(t, SIZES[0])[0][0] == "tree")
    thin, full = topos["rail 2:1"], topos["rail 1:1"]
    claims.close("2:1 above the rails: flat ring 2x slower at 4 GiB",
                 times["rail 2:1", "flat_ring"][-1] / times["rail 1:1", "flat_ring"][-1], 2.0,
                 0.05)
    claims.close("2:1 above the rails: hierarchical unchanged",
                 T.all_reduce_time(thin, "hierarchical", S) / T.all_reduce_time(full,
                                                                               "hierarchical",
                                                                               S), 1.0, 1e-9)
    one = T.all_reduce_time(T.Topology(1, a), "flat_ring", S)
    claims.check("one node: NVLink ring far faster than any multi-node all-reduce",
                 f"{one * 1e3:.2f} ms", "< best 16-node",
                 one < min(T.best(t, S)[0][1] for t in topos.values()))

    plt = C.pyplot()
    fig, axes = plt.subplots(1, len(topos), figsize=(4 * len(topos), 3.6), sharey=True)
    for ax, name in zip(axes, topos):
        for alg in T.ALGORITHMS:
            ax.loglog(SIZES, np.array(times[name, alg]) * 1e3, marker=".", label=alg)
        ax.set(title=name, xlabel="bytes per GPU")
    axes[0].set_ylabel("all-reduce time, ms (model)")
    axes[0].legend(fontsize=8)
    C.save(fig, args.out, "topology.png")
    claims.finish(args.out, {"sizes": SIZES, "times": {f"{n}|{a_}": v for (n, a_), v in
                                                       times.items()}})


if __name__ == "__main__":
    main()
