"""Strategies: each adds logical->mesh rules or a step transform; see each module docstring."""
