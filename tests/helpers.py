"""Shared test builders: small configs on the simulated 8-device CPU."""
import os

from jaxscale.analysis.harness import MESH_1  # noqa: F401  (one device)
from jaxscale.analysis.validation import PLANS, tiny_config  # noqa: F401  (the validation set)

#: `--set` flags for a small CLI run (subprocess tests): real updates from the first step (no
#: warm-up from lr 0), and an lr that does not depend on train.steps.
SMALL_ARGS = ["--set", "model.n_layers=2", "--set", "data.seq_len=32", "--set", "data.batch_size=8",
              "--set", "data.max_bytes=400000", "--set", "train.eval_every=0",
              "--set", "optim.warmup_steps=0", "--set", "optim.decay_steps=100"]


def subprocess_env(tmp_path_factory) -> dict:
    """Environment for CLI subprocesses: CPU, unbuffered, one compilation cache for the session."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def assert_temp_within_tolerance(cmp: dict) -> None:
    """The planner's temp against the compiled step's, within `validation.TOLERANCE` (15%)."""
    from jaxscale.analysis.validation import TOLERANCE
    temp = next(r["ratio"] for r in cmp["memory"] if r["what"] == "temp")
    assert abs(temp - 1) <= TOLERANCE["temp"], cmp["memory"]
