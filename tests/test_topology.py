"""Network topologies (`jaxscale.comm.topology`, plain Python): which flows are fast on each, and
the all-reduce algorithm each favours; one node reduces to the NVLink ring."""
import pytest

from jaxscale.comm import topology as T
from jaxscale.comm.algorithm_cost import Link, flat_ring_time, hierarchical_time


def test_flows_follow_the_topology():
    fat = T.FatTree(8, 8, leaf_nodes=4, oversubscription=4)
    assert fat.flow((0, 1), (0, 5)) == fat.intra                        # inside a node
    assert fat.flow((0, 0), (3, 0)).bandwidth == fat.nic.bandwidth      # same leaf
    assert fat.flow((0, 0), (4, 0)).bandwidth == fat.nic.bandwidth / 4  # across the spine
    rail = T.RailOptimized(8, 8, oversubscription=2)
    assert rail.flow((0, 3), (7, 3)).bandwidth == rail.nic.bandwidth    # same rail: one hop
    assert rail.flow((0, 7), (1, 0)).bandwidth == rail.nic.bandwidth / 2
    assert rail.flow((0, 7), (1, 0)).alpha > rail.flow((0, 3), (7, 3)).alpha
    fly = T.Dragonfly(8, 8, group_nodes=4, global_bw=100e9)
    assert fly.flow((0, 0), (5, 0), senders=8).bandwidth == 100e9 / 8


def test_one_node_is_the_nvlink_ring_and_two_levels_match_algorithm_cost():
    one = T.Topology(1, 8)
    assert T.all_reduce_time(one, "flat_ring", 1e9) == pytest.approx(
        2 * 7 * (one.intra.alpha + 1e9 / 8 / one.intra.bandwidth))
    # a plain switch: the same numbers as algorithm_cost's two-level model
    flat = T.Topology(4, 8, switch_latency=0.0)
    inter = Link(flat.nic.alpha, flat.nic.bandwidth)
    assert T.all_reduce_time(flat, "hierarchical", 1e9) == pytest.approx(
        hierarchical_time(1e9, 8, 4, flat.intra, inter))
    assert T.all_reduce_time(flat, "flat_ring", 1e9) == pytest.approx(
        flat_ring_time(1e9, 8, 4, flat.intra, inter))


@pytest.mark.parametrize("topo", [T.FatTree(16, 8, oversubscription=4), T.RailOptimized(16, 8),
                                  T.Dragonfly(16, 8)], ids=lambda t: t.name)
def test_hierarchical_beats_the_flat_ring_where_the_network_is_slower(topo):
    for S in (16e6, 1e9):
        assert T.all_reduce_time(topo, "hierarchical", S) < T.all_reduce_time(topo, "flat_ring",
                                                                              S) / 2
    assert T.best(topo, 1e9)[0][0] == "hierarchical"
    assert T.network_bytes(topo, "hierarchical", 1e9) == pytest.approx(2 * 15 / 128 * 1e9)


def test_small_messages_favour_the_tree_and_oversubscription_hurts_the_ring():
    rail = T.RailOptimized(16, 8)
    assert T.best(rail, 1e5)[0][0] == "tree"                      # log steps beat 2 (N-1)
    thin = T.RailOptimized(16, 8, oversubscription=2)
    assert T.all_reduce_time(thin, "flat_ring", 1e9) > 1.9 * T.all_reduce_time(rail, "flat_ring",
                                                                                1e9)
    # rails keep the hierarchical all-reduce's network traffic on one hop at full speed
    assert T.all_reduce_time(thin, "hierarchical", 1e9) == T.all_reduce_time(rail,
                                                                            "hierarchical", 1e9)


@pytest.mark.parametrize("call, message", [
    (lambda: T.Topology(0, 8), "nodes >= 1"),
    (lambda: T.all_reduce_time(T.Topology(2, 8), "butterfly", 1.0), "unknown algorithm"),
    (lambda: T.all_reduce_time(T.Topology(2, 8), "tree", -1.0), "nbytes must be >= 0"),
])
def test_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call()
