"""Benchmarks: scripts that print tables and write JSON and PNG, with ratios measured side by side
in one run. `jaxscale.bench.collectives`: nccl-tests-style sweep, JAX against torch.distributed.

Modules here import jax lazily, so that a `main` can still set `XLA_FLAGS` (simulated CPU devices)
before jax starts.
"""
