"""Published LLaMA configurations (exact parameter counts) and tiny ones for tests and CPU runs."""
from __future__ import annotations

from jaxscale.models.llama import ModelConfig, RopeScaling

CONFIGS: dict[str, ModelConfig] = {
    # byte-level vocabulary (256 bytes + pad/bos/eos, rounded up to 320 so tp up to 64 divides it)
    "tiny": ModelConfig(vocab_size=320, dim=128, n_layers=4, n_heads=8, n_kv_heads=4,
                        ffn_dim=384, max_seq_len=1024),
    "small": ModelConfig(vocab_size=320, dim=256, n_layers=8, n_heads=8, n_kv_heads=4,
                         ffn_dim=768, max_seq_len=2048),
    "llama2-7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                             ffn_dim=11008, max_seq_len=4096, rope_theta=10000.0),
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              ffn_dim=28672, max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128,
                               n_kv_heads=8, ffn_dim=53248, max_seq_len=8192, rope_theta=500000.0),
    # the tiny model with 8 experts (top-2) in every layer: 5.0M parameters, 1.5M active
    "tiny-moe": ModelConfig(vocab_size=320, dim=128, n_layers=4, n_heads=8, n_kv_heads=4,
                            ffn_dim=384, max_seq_len=1024, moe_experts=8, moe_top_k=2),
    # DeepSeek-MoE style (fine-grained, shared, auxiliary-loss-free), tiny: 16 experts of width
    # 96 (top-4) beside one shared expert, routed by a bias balanced from the load, dropless
    "tiny-deepseek-moe": ModelConfig(vocab_size=320, dim=128, n_layers=4, n_heads=8,
                                     n_kv_heads=4, ffn_dim=384, max_seq_len=1024,
                                     moe_experts=16, moe_top_k=4, moe_ffn_dim=96,
                                     moe_shared_experts=1, moe_bias_rate=0.001,
                                     moe_aux_weight=0.0, moe_dropless=True),
    # 46,702,792,704 parameters, 12,879,925,248 active (2 of 8 experts per token)
    "mixtral-8x7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                ffn_dim=14336, max_seq_len=32768, rope_theta=1e6, moe_experts=8,
                                moe_top_k=2),
}
for _n in ("8b", "70b", "405b"):
    CONFIGS[f"llama3.1-{_n}"] = ModelConfig(**{**CONFIGS[f"llama3-{_n}"].__dict__,
                                               "max_seq_len": 131072,
                                               "rope_scaling": RopeScaling()})


def get(name: str) -> ModelConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(CONFIGS)}") from None
