"""JAX side of the collectives sweep: jitted `jax.shard_map` collectives, timed call by call.

`JaxSide(world)` runs each kind over a 1-D mesh (axis `dp`) of the first `world` devices, float32:
all_reduce = `psum`; all_gather = `all_gather(tiled)` of S/n per device; reduce_scatter =
`psum_scatter(tiled)`; all_to_all = `all_to_all(tiled)`; permute = `ppermute` ring shift i -> i+1;
broadcast = `psum` of the buffer masked to zero off device 0. JAX has no broadcast collective
inside shard_map; the masked psum is what replicating one device's value costs there, an
all-reduce, so its busbw (factor 1) understates what a real broadcast reaches.

`time_all_reduce` runs the hand-written all-reduces of `jaxscale.comm.algorithms` (ring,
halving-doubling, recursive doubling; hierarchical over 2 simulated nodes of n/2 devices, mesh
`dp` x `fsdp`) beside `psum`; `time_chain(k, ...)` times k ring shifts inside one jitted call (one
ppermute = one algorithm step), which calibrates the alpha-beta model. Each call is timed alone,
after the untimed warm-up calls. jax is imported inside the methods only, so that
`jaxscale.comm.bench.main` can set XLA_FLAGS before jax starts.
"""
from __future__ import annotations

import time

from jaxscale.comm.torch_bench import KINDS


class JaxSide:
    """Jitted shard_map collectives over a 1-D mesh (axis `dp`) of the first `world` devices."""

    def __init__(self, world: int):
        import jax

        from jaxscale.mesh import MeshConfig, make_mesh
        devices = jax.devices()[:world]
        self.n, self.platform = world, devices[0].platform
        self.mesh = make_mesh(MeshConfig(dp=world), devices=devices)
        self.mesh2 = None
        if world >= 4 and world % 2 == 0:  # two simulated nodes of world/2 devices
            self.mesh2 = make_mesh(MeshConfig(dp=2, fsdp=world // 2, dcn_dp=2), devices=devices)
        self._fns: dict = {}

    def elements(self, nbytes: int) -> int:
        """float32 elements per device: a multiple of n, at least n."""
        return max(nbytes // 4 // self.n, 1) * self.n

    def _fn(self, kind: str):
        if kind in self._fns:
            return self._fns[kind]
        import jax
        from jax.sharding import PartitionSpec as P
        ax, n, lax = "dp", self.n, jax.lax
        bodies = {
            "all_reduce": lambda b: lax.psum(b, ax),
            "all_gather": lambda b: lax.all_gather(b, ax, tiled=True),
            "reduce_scatter": lambda b: lax.psum_scatter(b, ax, tiled=True),
            "all_to_all": lambda b: lax.all_to_all(b, ax, 0, 0, tiled=True),
            "broadcast": lambda b: lax.psum(jax.numpy.where(lax.axis_index(ax) == 0, b, 0), ax),
            "permute": lambda b: lax.ppermute(b, ax, [(j, (j + 1) % n) for j in range(n)]),
        }
        if kind not in bodies:
            raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")
        fn = jax.jit(jax.shard_map(bodies[kind], mesh=self.mesh, in_specs=P(ax),
                                   out_specs=P(ax)))
        self._fns[kind] = fn
        return fn

    def _chain(self, k: int):
        """k ring shifts in a row inside one jitted call (k collective-permutes)."""
        if ("chain", k) not in self._fns:
            import jax
            from jax.sharding import PartitionSpec as P
            ring = [(j, (j + 1) % self.n) for j in range(self.n)]

            def body(b):
                for _ in range(k):
                    b = jax.lax.ppermute(b, "dp", ring)
                return b
            self._fns["chain", k] = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P("dp"),
                                                          out_specs=P("dp")))
        return self._fns["chain", k]

    def time_chain(self, k: int, nbytes: int, iters: int, warmup: int) -> list[float]:
        from jax.sharding import PartitionSpec as P
        x = self._input((self.n * self.elements(nbytes),), self.mesh, P("dp"))
        return _time_calls(self._chain(k), x, iters, warmup)

    def _input(self, shape, mesh, spec):
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        return jax.device_put(np.ones(shape, np.float32), NamedSharding(mesh, spec))

    def time(self, kind: str, nbytes: int, iters: int, warmup: int) -> list[float]:
        from jax.sharding import PartitionSpec as P
        m = self.elements(nbytes)
        shape = (m,) if kind == "all_gather" else (self.n * m,)  # global; S/n or S per device
        return _time_calls(self._fn(kind), self._input(shape, self.mesh, P("dp")), iters, warmup)

    def algorithms(self) -> list[str]:
        pow2 = self.n & (self.n - 1) == 0
        algs = ["psum", "ring"] + (["halving_doubling", "recursive_doubling"] if pow2 else [])
        return algs + (["hierarchical"] if self.mesh2 is not None else [])

    def time_all_reduce(self, algorithm: str, nbytes: int, iters: int, warmup: int,
                        check: bool = False) -> list[float]:
        from jax.sharding import PartitionSpec as P

        from jaxscale.comm import algorithms as C
        two = algorithm == "hierarchical"
        mesh, axes = (self.mesh2, ("dp", "fsdp")) if two else (self.mesh, ("dp",))
        fn = C.all_reduce_fn(mesh, axes, algorithm)
        x = self._input((self.n, self.elements(nbytes)), mesh, P(axes if two else "dp"))
        if check:  # each row of the result is the sum of the n rows of ones
            import numpy as np
            got = np.asarray(fn(x))
            if not np.allclose(got, self.n):
                raise AssertionError(f"{algorithm} all-reduce gave {got.ravel()[:4]}, "
                                     f"expected {self.n}")
        return _time_calls(fn, x, iters, warmup)


def _time_calls(fn, x, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn(x).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times
