"""The caching-allocator simulator: rounding, best fit, splitting, coalescing, caching."""
from jaxscale.analysis import allocator as sim

MiB, KiB = sim.MiB, sim.KiB


def test_rounding_and_small_pool_segments():
    a = sim.CachingAllocator()
    a.malloc("x", 1)
    assert a.allocated == 512 and a.requested == 1
    assert a.reserved == 2 * MiB                  # one small segment
    a.malloc("y", 700)
    assert a.allocated == 512 + 1024 and a.reserved == 2 * MiB and a.n_device_allocs == 1


def test_split_free_coalesce_and_reuse_without_a_new_segment():
    a = sim.CachingAllocator(block_size=8 * MiB)
    for k in "abc":
        a.malloc(k, 2 * MiB)                      # large pool: one 8 MiB segment, split
    assert a.n_device_allocs == 1 and a.reserved == 8 * MiB
    for k in "bac":                               # free the middle first, then its neighbours
        a.free(k)
    assert a.allocated == 0 and a.requested == 0
    a.malloc("big", 8 * MiB)                      # the coalesced segment fits whole
    assert a.n_device_allocs == 1 and a.reserved == 8 * MiB


def test_best_fit_takes_the_smallest_free_block_that_fits():
    a = sim.CachingAllocator(block_size=2 * MiB)
    a.malloc("four", 4 * MiB)                     # two separate 4 MiB and 6 MiB segments
    a.malloc("six", 6 * MiB)
    a.free("six")
    a.free("four")
    a.malloc("x", 3 * MiB)                        # 4 MiB block is the best fit
    block, _ = a.live["x"]
    assert a.segments[block.segment] == 4 * MiB
    assert a.n_device_allocs == 2


def test_fragmentation_blocks_a_request_that_total_free_bytes_could_hold():
    a = sim.CachingAllocator(block_size=4 * MiB)
    for i in range(4):
        a.malloc(i, 2 * MiB)                      # two 4 MiB segments, each split in halves
    a.free(0)
    a.free(2)                                     # 4 MiB free, but in two separate segments
    a.malloc("x", 4 * MiB)
    assert a.n_device_allocs == 3 and a.reserved == 12 * MiB


def test_empty_cache_releases_only_wholly_free_segments():
    a = sim.CachingAllocator(block_size=2 * MiB)
    a.malloc("a", 2 * MiB)
    a.malloc("b", 2 * MiB)
    a.free("a")
    a.empty_cache()
    assert a.reserved == 2 * MiB


def test_replay_patterns_balance_and_report_fragmentation():
    r = sim.replay(sim.uniform(n=500), block_size=2 * MiB)
    assert r["final_live"] == 0 and r["final_allocated"] == 0
    assert r["peak_reserved"] >= r["peak_live"] > 0
    assert 0 <= r["fragmentation_at_peak"] < 1
    g = sim.replay(sim.growing(steps=16), block_size=2 * MiB)
    assert g["fragmentation_at_peak"] > r["fragmentation_at_peak"]
