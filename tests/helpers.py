"""Shared test builders: small configs on the simulated 8-device CPU."""
import dataclasses

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
