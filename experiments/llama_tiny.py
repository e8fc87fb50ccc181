"""The default run: a tiny LLaMA on 8 simulated CPU devices (dp=2 x fsdp=2 x tp=2), trained on this
machine's Python standard library sources with a byte-level tokenizer.

    jaxscale train llama_tiny              # ~3 minutes on 2 CPU cores
    jaxscale inspect llama_tiny --json     # compile only: memory, collective census, FLOPs, theory
"""
from jaxscale import meshes, models
from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        name="llama_tiny",
        model=models.get("tiny"),
        mesh=meshes.get("cpu8"),
        data=DataConfig(seq_len=128, batch_size=16),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        train=TrainConfig(steps=200, eval_every=25, eval_batches=4),
    )
