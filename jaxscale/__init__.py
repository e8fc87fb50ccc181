"""jaxscale: LLM training strategies as sharding annotations over a JAX device mesh."""
__version__ = "0.1.0"
