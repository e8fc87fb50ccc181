"""Network topologies between nodes, and the all-reduce algorithms they favour.

A cluster is `nodes` x `gpus` devices: inside a node one fast fabric (NVLink: `Link` of latency
and per-device bandwidth), between nodes one NIC per GPU into a network whose shape decides what
bandwidth and how many switch hops a flow between two GPUs gets:

- `FatTree` (Clos): leaves of `leaf_nodes` nodes, spines above; a flow between nodes under one
  leaf takes 2 hops at NIC speed, a flow across leaves 4 hops at NIC speed / `oversubscription`
  (the leaf's uplinks are that much thinner than its downlinks).
- `RailOptimized`: GPU i of every node hangs off rail switch i. GPU i to GPU i of another node is
  1 hop at NIC speed; GPU i to GPU j != i must climb to the spine (3 hops, / oversubscription).
- `Dragonfly`: groups of `group_nodes` nodes, all-to-all inside a group (2 hops, NIC speed);
  between groups one global link per router pair, shared by the group's GPUs: bandwidth
  `global_bw` / (GPUs of a group sending at once), 3 hops.

Algorithms for an all-reduce of S bytes on N = nodes x gpus devices (node-major order), each a
sequence of synchronous steps whose time is that of the slowest flow in it (`alpha_beta` per
flow: hops x `switch_latency` + the link's latency, bytes / bandwidth):

- `flat_ring`: 2 (N-1) steps of S/N; with more than one node some ring hops cross nodes (node n's
  last GPU to node n+1's first: a cross-rail flow), so every step waits for the network;
- `tree`: NCCL's double binary tree in its pipelined large-message form: 2 log2(N) latency steps
  and 2 S through the slowest link, between nodes over the NIC (same-rail, GPU 0 of each node);
- `hierarchical`: ring reduce-scatter inside the node (NVLink), an all-reduce of S/gpus per rail
  across nodes (GPU i of each node: same-rail flows, every NIC busy at once), ring all-gather
  inside the node; it moves only 2 (nodes-1)/N x S per device over the network.

`best(topology, S)` ranks them; `jaxscale.comm.algorithms` holds the same algorithms written
with `ppermute` for one machine (their alpha-beta model, and `Link`, in
`jaxscale.comm.algorithm_cost`), and `experiments/27_topology.py` compares the topologies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxscale.comm.algorithm_cost import Link

ALGORITHMS = ("flat_ring", "tree", "hierarchical")


@dataclass(frozen=True)
class Topology:
    """Common part: `nodes` x `gpus`, the NVLink `intra` link, the NIC `nic` link (per GPU, one
    way), and the latency each switch hop adds."""
    nodes: int
    gpus: int
    intra: Link = Link(2e-6, 370e9)          # NVLink 4 busbw per GPU (8 x H100)
    nic: Link = Link(3e-6, 50e9)             # 400 Gb/s InfiniBand per GPU
    switch_latency: float = 0.3e-6
    name: str = "flat"

    def __post_init__(self):
        if self.nodes < 1 or self.gpus < 1:
            raise ValueError(f"a cluster needs nodes >= 1 and gpus >= 1, got {self.nodes} x "
                             f"{self.gpus}")

    @property
    def n(self) -> int:
        return self.nodes * self.gpus

    def flow(self, src: tuple[int, int], dst: tuple[int, int], senders: int = 1) -> Link:
        """Latency and bandwidth of one flow (node, gpu) -> (node, gpu) while `senders` GPUs of
        the source node send across the network at once."""
        if src[0] == dst[0]:
            return self.intra
        hops, bw = self.route(src, dst, senders)
        return Link(self.nic.alpha + hops * self.switch_latency, bw)

    def route(self, src, dst, senders: int) -> tuple[int, float]:
        """(switch hops, bandwidth) between two nodes; a plain non-blocking switch here."""
        return 1, self.nic.bandwidth


@dataclass(frozen=True)
class FatTree(Topology):
    leaf_nodes: int = 4
    oversubscription: float = 1.0
    name: str = "fat-tree"

    def route(self, src, dst, senders):
        if src[0] // self.leaf_nodes == dst[0] // self.leaf_nodes:
            return 2, self.nic.bandwidth
        return 4, self.nic.bandwidth / self.oversubscription


@dataclass(frozen=True)
class RailOptimized(Topology):
    oversubscription: float = 1.0
    name: str = "rail-optimised"

    def route(self, src, dst, senders):
        if src[1] == dst[1]:
            return 1, self.nic.bandwidth
        return 3, self.nic.bandwidth / self.oversubscription


@dataclass(frozen=True)
class Dragonfly(Topology):
    group_nodes: int = 4
    global_bw: float = 200e9               # per pair of groups
    name: str = "dragonfly"

    def route(self, src, dst, senders):
        if src[0] // self.group_nodes == dst[0] // self.group_nodes:
            return 2, self.nic.bandwidth
        return 3, min(self.nic.bandwidth, self.global_bw / max(1, senders))


def _step(links: list[Link], nbytes: float) -> float:
    return max(link.alpha + nbytes / link.bandwidth for link in links)


def all_reduce_time(topo: Topology, algorithm: str, nbytes: float) -> float:
    """Seconds for one all-reduce of `nbytes` per device on `topo` by `algorithm`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    a, b, n = topo.gpus, topo.nodes, topo.n
    if n == 1:
        return 0.0
    if algorithm == "flat_ring":
        order = [(i // a, i % a) for i in range(n)]
        links = [topo.flow(order[i], order[(i + 1) % n], senders=1) for i in range(n)]
        return 2 * (n - 1) * _step(links, nbytes / n)
    if algorithm == "tree":
        steps = 2 * math.ceil(math.log2(n))
        inter = [topo.flow((0, 0), (j, 0), senders=1) for j in range(1, b)]
        slow = min([topo.intra] + inter, key=lambda link: link.bandwidth)
        lat = max([topo.intra] + inter, key=lambda link: link.alpha).alpha
        return steps * lat + 2 * nbytes / slow.bandwidth
    t = 2 * (a - 1) * _step([topo.intra], nbytes / a) if a > 1 else 0.0     # RS + AG in node
    if b > 1:       # per rail: GPU i of every node, all rails at once
        links = [topo.flow((j, i), ((j + 1) % b, i), senders=a) for j in range(b)
                 for i in range(a)]
        t += 2 * (b - 1) * _step(links, nbytes / (a * b))
    return t


def best(topo: Topology, nbytes: float) -> list[tuple[str, float]]:
    """Every algorithm's time on `topo`, fastest first."""
    return sorted(((alg, all_reduce_time(topo, alg, nbytes)) for alg in ALGORITHMS),
                  key=lambda x: x[1])


def network_bytes(topo: Topology, algorithm: str, nbytes: float) -> float:
    """Bytes one device sends over the network (not NVLink) per all-reduce."""
    a, b, n = topo.gpus, topo.nodes, topo.n
    if b == 1:
        return 0.0
    if algorithm == "flat_ring":   # only the node's last GPU sends across; averaged per device
        return 2 * (n - 1) * nbytes / n * (b / n)
    if algorithm == "tree":
        return 2 * nbytes / a
    return 2 * (b - 1) / n * nbytes
