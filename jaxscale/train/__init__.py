"""Training: sharded state, the pure train step, and the loop."""
