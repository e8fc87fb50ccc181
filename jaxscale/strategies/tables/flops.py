"""Matmul FLOPs per token of the model's parts, as the compiled step computes them.

The planner's FLOPs and step time (`jaxscale.planner.perf`) and the pipeline's stage balance
(`jaxscale.strategies.pp.stages`) read the same table: per block, by part (q, k, v, o, the
attention core, the MLP or the mixture of experts), and the LM head.
"""
from __future__ import annotations

from jaxscale.strategies.tables.activations import expert_rows, ragged_dense


def layer_flops_per_token(model, seq_len: int, causal_kernel: bool, expert_rows: float = 0.0,
                          moe_share: float = 1.0) -> dict:
    """Forward matmul FLOPs per token of one block, by part; a mixture of experts computes
    `expert_rows` expert MLP rows per token (`tables.activations.expert_rows`: the slots of its
    capacity buffer, padding included) plus the router, in `moe_share` of the layers (the rest are
    dense)."""
    d, hd, H, K, f, E = (model.dim, model.hd, model.n_heads, model.n_kv_heads, model.ffn_dim,
                         model.moe_experts)
    attn_core = 4 * seq_len * H * hd * (0.5 if causal_kernel else 1.0)
    share = moe_share if E else 0.0
    fe, fs = (model.expert_ffn, model.moe_shared_experts * model.expert_ffn) if E else (f, 0)
    mlp = (6 * d * f * (1 - share) + 6 * d * share * ((expert_rows or model.moe_top_k) * fe + fs)
           + 2 * d * E * share)
    return {"q_proj": 2 * d * H * hd, "k_proj": 2 * d * K * hd, "v_proj": 2 * d * K * hd,
            "o_proj": 2 * H * hd * d, "attention": attn_core,
            "mlp_gate": mlp / 3, "mlp_up": mlp / 3, "mlp_down": mlp / 3}


def moe_rows(spec) -> tuple[float, float]:
    """(expert MLP rows computed per token, fraction of MoE layers) as the compiled step does it:
    `expert_rows`, except that the grouped experts on a CPU run `jax.lax.ragged_dot`'s
    reference lowering, a dense matmul of every row with every local expert."""
    m = spec.model
    if not spec.moe:
        return 0.0, 0.0
    rows = expert_rows(spec)
    if ragged_dense(spec):
        rows *= m.moe_experts // spec.deg("ep")
    return rows, m.n_moe_layers / m.n_layers


def head_flops_per_token(model) -> float:
    """Forward FLOPs per token of the LM head (2 x dim x the padded vocabulary)."""
    return 2.0 * model.dim * model.padded_vocab
