"""The GPT-style block of the literature (LayerNorm, GeLU, dropout, 16-bit), for published tables.

Activations per layer (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198, section 4), s = sequence, b = micro-batch, h = hidden,
a = heads, t = tensor-parallel degree, in bytes (2-byte activations, 1-byte dropout masks):

| tensor                                  | bytes   | region   |
|-----------------------------------------|---------|----------|
| LayerNorm 1 input                       | 2 sbh   | residual |
| QKV matmul input                        | 2 sbh   | residual |
| Q and K (for QK^T)                      | 4 sbh   | tp       |
| softmax output                          | 2 as^2b | tp, core |
| softmax dropout mask                    | as^2b   | tp, core |
| softmax dropout output                  | 2 as^2b | tp, core |
| V                                       | 2 sbh   | tp       |
| output projection input                 | 2 sbh   | tp       |
| attention dropout mask                  | sbh     | residual |
| LayerNorm 2 input                       | 2 sbh   | residual |
| MLP first matmul input                  | 2 sbh   | residual |
| GeLU input                              | 8 sbh   | tp       |
| GeLU output (second matmul input)       | 8 sbh   | tp       |
| MLP dropout mask                        | sbh     | residual |

Attention 11 sbh + 5 as^2 b, MLP 19 sbh, norms 4 sbh: 34 sbh + 5 as^2 b. The six variants follow
from splitting the table: tensor parallelism divides the `tp` rows by t; sequence parallelism
divides the `residual` rows by t as well; selective recompute drops the `core` rows (the
attention softmax and dropout, recomputed in the backward); full recompute keeps only the layer
input (2 sbh). `activation_bytes` computes every variant from the table; `closed_form` is the
paper's formula, and the tests check that the two agree.

`GPTConfig`/`plan_3d` give per-GPU memory and communication by mesh axis for the published 3D
layouts (GPT-3 175B with Megatron, BLOOM 176B) in `experiments/19_3d_parallelism.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxscale.planner.memory import model_states
from jaxscale.strategies.common import Comm

#: (name, bytes per token as a multiple of h (or of a*s for the score rows), region, core)
GPT_BLOCK = (
    ("ln1_input", 2, "res", False), ("qkv_input", 2, "res", False), ("q_and_k", 4, "tp", False),
    ("softmax_out", 2, "score", True), ("softmax_dropout_mask", 1, "score", True),
    ("softmax_dropout_out", 2, "score", True), ("v", 2, "tp", False),
    ("proj_input", 2, "tp", False), ("attn_dropout_mask", 1, "res", False),
    ("ln2_input", 2, "res", False), ("mlp_input", 2, "res", False), ("gelu_input", 8, "tp", False),
    ("gelu_output", 8, "tp", False), ("mlp_dropout_mask", 1, "res", False),
)
VARIANTS = ("none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full")


def activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, variant: str = "none") -> float:
    """Bytes of activations per layer per device, summed from `GPT_BLOCK`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: valid are {', '.join(VARIANTS)}")
    if variant == "full":
        return 2 * s * b * h
    tp = t if variant != "none" else 1
    sp = "sp" in variant
    selective = "selective" in variant
    total = 0.0
    for _, k, region, core in GPT_BLOCK:
        if core and selective:
            continue
        if region == "score":
            total += k * a * s * s * b / tp
        elif region == "tp":
            total += k * s * b * h / tp
        else:
            total += k * s * b * h / (tp if sp else 1)
    return total


def closed_form(s: int, b: int, h: int, a: int, t: int = 1, variant: str = "none") -> float:
    """Korthikanti et al.'s per-layer formulas (arXiv 2205.05198, Table 2)."""
    sbh = s * b * h
    return {"none": sbh * (34 + 5 * a * s / h),
            "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
            "tp+sp": sbh / t * (34 + 5 * a * s / h),
            "tp+selective": sbh * (10 + 24 / t),
            "tp+sp+selective": 34 * sbh / t,
            "full": 2 * sbh}[variant]


@dataclass(frozen=True)
class GPTConfig:
    name: str
    n_layers: int
    dim: int
    n_heads: int
    vocab_size: int
    seq_len: int
    learned_positions: bool = True
    embedding_norm: bool = False

    def param_count(self) -> int:
        """12 L h^2 + 13 L h (QKV, projection, 4h MLP, two LayerNorms, biases) + embeddings."""
        h = self.dim
        n = self.n_layers * (12 * h * h + 13 * h) + self.vocab_size * h + 2 * h
        n += self.seq_len * h if self.learned_positions else 0
        return n + (2 * h if self.embedding_norm else 0)


GPT3_175B = GPTConfig("gpt3-175b", 96, 12288, 96, 50257, 2048)
BLOOM_176B = GPTConfig("bloom-176b", 70, 14336, 112, 250880, 2048, learned_positions=False,
                       embedding_norm=True)


@dataclass
class Layout3D:
    memory: dict          # bytes per GPU: params, grads, master, optimizer, activations, total
    collectives: list     # Comm records per GPU per step
    bubble: float         # pipeline idle fraction of the step (p - 1) / (m + p - 1)


def plan_3d(cfg: GPTConfig, t: int, p: int, d: int, micro_batch: int, global_batch: int,
            zero: int = 0, variant: str = "tp+selective") -> Layout3D:
    """Megatron-style 3D layout: tensor t, pipeline p (1F1B), data d; 16-bit mixed precision."""
    psi = cfg.param_count() / (t * p)
    states = model_states(psi, d, zero, mixed=True)
    m = global_batch // (micro_batch * d)           # micro-batches per pipeline per step
    s, h = cfg.seq_len, cfg.dim
    per_layer = activation_bytes(s, micro_batch, h, cfg.n_heads, t, variant)
    acts = per_layer * cfg.n_layers / p * min(m, p)  # 1F1B: p micro-batches in flight at stage 0
    mem = dict(states, activations=acts)
    mem["total"] = sum(mem.values())
    act_msg = micro_batch * s * h * 2
    L = cfg.n_layers / p
    out = [Comm("all-reduce", ("tp",), 4 * L * m * act_msg, int(4 * L * m),
                "Megatron TP: 2 forward + 2 backward per layer", group=t),
           Comm("collective-permute", ("pp",), 2 * m * act_msg / (t if "sp" in variant else 1),
                2 * m, "stage boundary activations and gradients", group=p, overlap=True),
           Comm("reduce-scatter" if zero >= 2 else "all-reduce", ("dp",), psi * 2, 1,
                "gradients (bf16)", group=d, overlap=True)]
    if zero in (1, 2):
        out.append(Comm("all-gather", ("dp",), psi * 2, 1, "updated parameters", group=d,
                        overlap=True))
    return Layout3D(mem, [c for c in out if c.group > 1], (p - 1) / (m + p - 1))
