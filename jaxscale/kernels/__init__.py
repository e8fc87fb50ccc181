"""Kernels: each beside a pure-jnp reference and a test."""
