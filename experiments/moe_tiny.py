"""A tiny mixture of experts (8 experts, top-2, every layer) on 8 simulated CPU devices, experts
split over ep=4 and the batch over dp=2 x ep=4, trained on this machine's Python standard library
sources with a byte-level tokenizer (models/moe.py, jaxscale/strategies/ep.py).

    jaxscale train moe_tiny                       # ~3 minutes on 2 CPU cores
    jaxscale inspect moe_tiny                     # compile only: the all-to-alls over ep
    jaxscale train moe_tiny --set model.moe_dropless=true --set mesh.ep=8 --set mesh.dp=1
"""
from jaxscale import models
from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig
from jaxscale.mesh import MeshConfig


def config() -> Config:
    return Config(
        name="moe_tiny",
        model=models.get("tiny-moe"),
        mesh=MeshConfig(dp=2, ep=4, device_kind="cpu"),
        data=DataConfig(seq_len=128, batch_size=16),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        train=TrainConfig(steps=200, eval_every=25, eval_batches=4),
    )
