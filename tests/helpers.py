"""Shared test builders: small configs on the simulated 8-device CPU."""
import dataclasses
import os

import meshes
import models
from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig, apply_overrides


def tiny_config(*overrides: str, **model_kw) -> Config:
    model = dataclasses.replace(models.get("tiny"), n_layers=2, **model_kw)
    cfg = Config(name="test", model=model, mesh=meshes.get("cpu8"),
                 data=DataConfig(seq_len=32, batch_size=8, max_bytes=400_000),
                 optim=OptimConfig(lr=1e-3, warmup_steps=2),
                 train=TrainConfig(steps=3, eval_every=0))
    return apply_overrides(cfg, list(overrides))


MESH_1 = ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1")
PLANS = {
    "dp8": ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1"),
    "fsdp8": ("mesh.dp=1", "mesh.fsdp=8", "mesh.tp=1"),
    "tp8": ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=8", "model.n_kv_heads=8"),
    "dp2xfsdp2xtp2": ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2"),
}


#: `--set` flags for a small CLI run (subprocess tests); lr does not depend on train.steps.
SMALL_ARGS = ["--set", "model.n_layers=2", "--set", "data.seq_len=32", "--set", "data.batch_size=8",
              "--set", "data.max_bytes=400000", "--set", "train.eval_every=0",
              "--set", "optim.decay_steps=100"]


def subprocess_env(tmp_path_factory) -> dict:
    """Environment for CLI subprocesses: CPU, unbuffered, one compilation cache for the session."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env
