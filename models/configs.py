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


def _gpt(n_layers: int, dim: int, n_heads: int, vocab: int = 51200) -> ModelConfig:
    """A GPT-3-style shape (Megatron-LM's GPT: LayerNorm, a GeLU MLP of width 4 h, tied
    embeddings, sequence 2048) as the LLaMA block with the same matmuls: multi-head attention
    (kv heads = heads) and a SwiGLU of width 8 h / 3 rounded to a multiple of 16 (3 h f = the GeLU
    MLP's 8 h^2), so 12 h^2 per layer and the same training FLOPs per token to 0.01% (biases,
    norms and learned positions aside). For the published runs the planner is checked against
    (`jaxscale.analysis.validation.PUBLISHED`)."""
    return ModelConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_heads, ffn_dim=round(8 * dim / 3 / 16) * 16,
                       max_seq_len=2048, tie_embeddings=True)


# Megatron-LM's weak-scaling models (Narayanan et al., SC'21, arXiv 2104.04473, Table 1), the
# 530B one MT-NLG's shape (arXiv 2201.11990); BLOOM (arXiv 2211.05100: vocabulary 250,880)
CONFIGS.update({"gpt-1.7b": _gpt(24, 2304, 24), "gpt-18.4b": _gpt(40, 6144, 48),
                "gpt-145.6b": _gpt(80, 12288, 96), "gpt-530b": _gpt(105, 20480, 128),
                "gpt-1t": _gpt(128, 25600, 160), "bloom-176b": _gpt(70, 14336, 112, 250880)})
for _n in ("8b", "70b", "405b"):
    CONFIGS[f"llama3.1-{_n}"] = ModelConfig(**{**CONFIGS[f"llama3-{_n}"].__dict__,
                                               "max_seq_len": 131072,
                                               "rope_scaling": RopeScaling()})


def get(name: str) -> ModelConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(CONFIGS)}") from None
