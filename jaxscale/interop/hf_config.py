"""Hugging Face `config.json` <-> `ModelConfig` for `LlamaForCausalLM` and `MixtralForCausalLM`
(transformers 4 `rope_theta` + `rope_scaling`, or transformers 5 `rope_parameters`); whatever the
jaxscale model cannot express is a `ValueError` naming the field. The weights:
`jaxscale/interop/hf.py`."""
from __future__ import annotations

from typing import Any

from jaxscale.models.llama import ModelConfig, RopeScaling

ARCHITECTURE = "LlamaForCausalLM"
MOE_ARCHITECTURE = "MixtralForCausalLM"
#: architecture -> model_type
ARCHITECTURES = {ARCHITECTURE: "llama", MOE_ARCHITECTURE: "mixtral"}

def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_scaling={params!r}: expected a dict or null")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters: per-layer-type RoPE settings are not supported "
                         "(jaxscale's LLaMA uses one RoPE for every layer)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported: jaxscale rotates the whole "
                         "head dimension")
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported; jaxscale implements "
                         f"'default' and 'llama3' (Llama-3.1 frequency scaling)")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if k not in params]
    if missing:
        raise ValueError(f"rope_scaling (llama3) lacks {', '.join(missing)}")
    return theta, RopeScaling(factor=float(params["factor"]),
                              low_freq_factor=float(params["low_freq_factor"]),
                              high_freq_factor=float(params["high_freq_factor"]),
                              original_max_position=int(params["original_max_position_embeddings"]))


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face LLaMA or Mixtral `config.json` dict; `overrides` set
    jaxscale-only fields (`scan_layers`, `attention`, `dtype`, ...). Unsupported settings raise
    ValueError."""
    model_type = hf.get("model_type", "llama")
    archs = hf.get("architectures") or [MOE_ARCHITECTURE if model_type == "mixtral"
                                        else ARCHITECTURE]
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ValueError(f"architectures={archs}: only {' and '.join(ARCHITECTURES)} can be "
                         f"loaded")
    if model_type != ARCHITECTURES[known[0]]:
        raise ValueError(f"model_type={model_type!r}: {known[0]} needs "
                         f"{ARCHITECTURES[known[0]]!r} (only 'llama' and 'mixtral' can be loaded)")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported: jaxscale's MLP is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            raise ValueError(f"{field}=true is not supported: jaxscale's LLaMA has no biases")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads"):
        if field not in hf:
            raise ValueError(f"config.json lacks {field}")
    theta, scaling = _rope_from_hf(hf)
    heads = int(hf["num_attention_heads"])
    kw: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]), dim=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        ffn_dim=int(hf["intermediate_size"]), head_dim=int(hf.get("head_dim") or 0),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)), rope_theta=theta,
        rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)))
    if kw["head_dim"] == kw["dim"] // heads and kw["dim"] % heads == 0:
        kw["head_dim"] = 0
    if model_type == "mixtral":
        kw.update(_moe_from_hf(hf))
    kw.update(overrides)
    return ModelConfig(**kw).validate()


def _moe_from_hf(hf: dict) -> dict:
    """The mixture-of-experts fields of a Mixtral `config.json` (every layer a mixture)."""
    for field in ("num_local_experts", "num_experts_per_tok"):
        if field not in hf:
            raise ValueError(f"config.json lacks {field}")
    if hf.get("sliding_window") is not None:
        raise ValueError(f"sliding_window={hf['sliding_window']}: sliding-window attention is "
                         f"not supported (jaxscale's attention is full causal); only "
                         f"sliding_window=null can be loaded")
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        raise ValueError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported: "
                         f"jaxscale's router has no input jitter")
    k = int(hf["num_experts_per_tok"])
    return dict(moe_experts=int(hf["num_local_experts"]), moe_top_k=k, moe_every=1,
                moe_dropless=True,
                moe_aux_weight=float(hf.get("router_aux_loss_coef", 0.001 * k)) / k)


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """The `config.json` of `cfg` (a `LlamaConfig`, or a `MixtralConfig` for a mixture of
    experts), readable by transformers 4 (`rope_theta`/`rope_scaling`) and 5 (`rope_parameters`)."""
    s = cfg.rope_scaling
    scaling = None if s is None else {
        "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings":
        s.original_max_position}
    out = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.hd, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default" if s is None else "llama3",
                            "rope_theta": cfg.rope_theta, **(scaling or {})},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": cfg.init_std, "torch_dtype": dtype, "dtype": dtype,
    }
    if not cfg.moe_experts:
        return out
    if cfg.moe_every != 1:
        raise ValueError(f"model.moe_every={cfg.moe_every}: Mixtral has a mixture of experts in "
                         f"every layer; only moe_every=1 can be exported")
    extra = {k: v for k, v in (("moe_shared_experts", cfg.moe_shared_experts),
                               ("moe_bias_rate", cfg.moe_bias_rate),
                               ("moe_ffn_dim", cfg.moe_ffn_dim)) if v}
    if extra:
        raise ValueError(f"{', '.join(f'model.{k}={v}' for k, v in extra.items())}: Mixtral has "
                         f"no shared experts, routing bias or separate expert width; export a "
                         f"model without them")
    for field in ("attention_bias", "mlp_bias"):
        del out[field]
    return {**out, "architectures": [MOE_ARCHITECTURE], "model_type": "mixtral",
            "num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
            "router_aux_loss_coef": cfg.moe_aux_weight * cfg.moe_top_k,
            "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None,
            "attention_dropout": 0.0}
