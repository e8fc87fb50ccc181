"""The jaxscale LLaMA as a plain PyTorch `nn.Module` (fp32), weight conversion, and the optimizer.

Same architecture as `models/llama.py`: RMSNorm (fp32 statistics), RoPE in the rotate-half layout
with optional Llama-3.1 frequency scaling, grouped-query attention (causal), SwiGLU MLP, untied or
tied LM head. Modules carry Hugging Face names (`model.layers.0.self_attn.q_proj`, `lm_head`, ...),
so the state dict is a `LlamaForCausalLM` state dict and the conversion to and from jaxscale params
is `jaxscale.interop.hf_tensors`'. Linear layers are `nn.Linear` ([out, in] weights) so that
DTensor tensor parallelism (`ColwiseParallel` / `RowwiseParallel`) applies as to any PyTorch
LLaMA; attention reshapes with -1 heads, so it runs on the local heads of a column-parallel
projection.

`AdamWLikeOptax` reproduces `jaxscale.train.state.make_optimizer`: the warmup + cosine schedule of
`optax.warmup_cosine_decay_schedule`, clipping by the global gradient norm the way
`optax.clip_by_global_norm` does (scale by max/norm only when norm >= max; the norm summed over
the shards of DTensor gradients), and `torch.optim.AdamW` (decoupled decay, which equals optax's
`adamw` update -lr * (adam + wd * p)) with no weight decay on the RMSNorm scales.

`parallelize(model, mode, ...)` applies the PyTorch strategies the baselines compare against:
DDP, FSDP2 (with and without resharding after forward), FSDP2 on a 2-D mesh, DTensor TP.

This module imports torch and numpy only (the jaxscale conversion functions import jax lazily), so
training workers start without jax.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TorchLlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    # Llama-3.1: {factor, low_freq_factor, high_freq_factor, original_max_position}; or None
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @classmethod
    def from_model_config(cls, cfg) -> "TorchLlamaConfig":
        """From a jaxscale `ModelConfig` (any object with its fields)."""
        s = cfg.rope_scaling
        return cls(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim,
                   cfg.hd, cfg.max_seq_len, float(cfg.rope_theta),
                   None if s is None else dict(factor=s.factor, low_freq_factor=s.low_freq_factor,
                                               high_freq_factor=s.high_freq_factor,
                                               original_max_position=s.original_max_position),
                   float(cfg.norm_eps), bool(cfg.tie_embeddings))

    def to_dict(self) -> dict:
        return asdict(self)


def rope_inv_freq(cfg: TorchLlamaConfig) -> torch.Tensor:
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    s = cfg.rope_scaling
    if s is not None:   # keep high frequencies, divide low ones by factor, blend in between
        wavelen = 2 * math.pi / inv
        low_wl = s["original_max_position"] / s["low_freq_factor"]
        high_wl = s["original_max_position"] / s["high_freq_factor"]
        smooth = (s["original_max_position"] / wavelen - s["low_freq_factor"]) / (
            s["high_freq_factor"] - s["low_freq_factor"])
        blended = (1 - smooth) * inv / s["factor"] + smooth * inv
        inv = torch.where(wavelen < high_wl, inv,
                          torch.where(wavelen > low_wl, inv / s["factor"], blended))
    return inv


def apply_rope(x_BTHD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BTHD.float().chunk(2, dim=-1)
    cos, sin = cos_TF[None, :, None, :], sin_TF[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x_BTHD.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TorchLlamaConfig):
        super().__init__()
        d, hd = cfg.dim, cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)

    def forward(self, x_BTD, cos, sin):
        B, T, _ = x_BTD.shape
        hd = self.head_dim
        q = apply_rope(self.q_proj(x_BTD).view(B, T, -1, hd), cos, sin)   # local heads under TP
        k = apply_rope(self.k_proj(x_BTD).view(B, T, -1, hd), cos, sin)
        v = self.v_proj(x_BTD).view(B, T, -1, hd)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TorchLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TorchLlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: TorchLlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, tokens_BT):
        T = tokens_BT.shape[1]
        pos = torch.arange(T, device=tokens_BT.device, dtype=torch.float32)
        ang_TF = pos[:, None] * self.inv_freq.to(tokens_BT.device)[None, :]
        cos, sin = torch.cos(ang_TF), torch.sin(ang_TF)
        x = self.embed_tokens(tokens_BT)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class TorchLlama(nn.Module):
    """tokens [B, T] (int64) -> logits [B, T, vocab] (fp32)."""

    def __init__(self, cfg: TorchLlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens_BT):
        h = self.model(tokens_BT)
        if self.cfg.tie_embeddings:
            return F.linear(h, self.model.embed_tokens.weight).float()
        return self.lm_head(h).float()


# ----------------------------------------------------------------------------- strategies
def parallelize(model, mode: str, world: int, device_type: str, hsdp_dp: int = 2):
    """Apply a PyTorch strategy to a full `TorchLlama` (weights loaded), as torchtitan would.

    dp: DDP; fsdp: FSDP2 `fully_shard` on each block, then the root (`fsdp_keep`: with
    `reshard_after_forward=False`, gathered blocks kept for the backward); hsdp: the same on a 2-D
    (replicate `hsdp_dp`, shard world/hsdp_dp) mesh; tp: DTensor `parallelize_module`, Megatron
    style: Q/K/V and gate/up column-parallel, O and down row-parallel, the embedding row-parallel
    (vocabulary split), the head column-parallel with vocabulary-sharded logits for
    `loss_parallel`."""
    from torch.distributed.device_mesh import init_device_mesh
    if mode == "dp":
        from torch.nn.parallel import DistributedDataParallel
        # the only buffer is the constant RoPE table: no per-step broadcast of it
        return DistributedDataParallel(model, broadcast_buffers=False)
    if mode in ("fsdp", "fsdp_keep", "hsdp"):
        from torch.distributed.fsdp import fully_shard
        mesh = (init_device_mesh(device_type, (world,)) if mode != "hsdp" else
                init_device_mesh(device_type, (hsdp_dp, world // hsdp_dp),
                                 mesh_dim_names=("replicate", "shard")))
        keep = mode == "fsdp_keep"      # no reshard after forward: no all-gather in backward
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=not keep)
        fully_shard(model, mesh=mesh)   # the root keeps its gathered weights (FSDP2's default)
        return model
    if mode == "tp":
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        if model.cfg.tie_embeddings:
            raise ValueError("the DTensor TP baseline needs an untied head "
                             "(model.tie_embeddings=0)")
        mesh = init_device_mesh(device_type, (world,))
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(len(model.model.layers)):
            p = f"model.layers.{i}."
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "mlp.gate_proj", "mlp.up_proj"):
                plan[p + name] = ColwiseParallel()
            plan[p + "self_attn.o_proj"] = RowwiseParallel()
            plan[p + "mlp.down_proj"] = RowwiseParallel()
        return parallelize_module(model, mesh, plan)
    raise ValueError(f"unknown strategy {mode!r}; valid: dp, fsdp, fsdp_keep, hsdp, tp")


# ----------------------------------------------------------------------------- conversion
def state_dict_from_jaxscale(params, model_cfg) -> dict[str, torch.Tensor]:
    """jaxscale params (jax or numpy arrays, scanned or not) -> a `TorchLlama` state dict."""
    from jaxscale.interop.hf_tensors import params_to_hf
    return {k: torch.from_numpy(np.array(v, dtype=np.float32))
            for k, v in params_to_hf(params, model_cfg).items()}


def jaxscale_from_state_dict(state_dict, model_cfg) -> dict:
    """A `TorchLlama` (or `LlamaForCausalLM`) state dict -> jaxscale params (numpy arrays)."""
    from jaxscale.interop.hf_tensors import hf_to_params
    return hf_to_params({k: v.detach().cpu().float().numpy() for k, v in state_dict.items()},
                        model_cfg)


# ----------------------------------------------------------------------------- optimizer
def warmup_cosine_lr(step: int, lr: float, warmup_steps: int, decay_steps: int,
                     min_lr_ratio: float) -> float:
    """`optax.warmup_cosine_decay_schedule(0, lr, min(warmup, decay), max(decay, warmup + 1),
    lr * min_lr_ratio)` at `step`, as `make_optimizer` builds it (`decay_steps` already resolved
    from `optim.decay_steps or train.steps`)."""
    warm = min(warmup_steps, decay_steps)
    total = max(decay_steps, warmup_steps + 1)
    if step < warm:
        return lr * step / warm
    span = total - warm
    t = min(step - warm, span)
    alpha = min_lr_ratio
    return lr * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * t / span)) + alpha)


def _shard_groups(t) -> tuple:
    """The mesh dims over which a DTensor's local pieces must be summed (its Shard dims)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(t, DTensor):
        return ()
    return tuple(i for i, p in enumerate(t.placements) if p.is_shard())


def global_grad_norm(params) -> torch.Tensor:
    """L2 norm of all gradients: local squares summed, then one all-reduce per set of sharded
    mesh dims (replicated pieces are counted once). Plain tensors count as replicated."""
    import torch.distributed as dist
    sums: dict[tuple, torch.Tensor] = {}
    meshes: dict[tuple, object] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if any(pl.is_partial() for pl in getattr(g, "placements", ())):
            raise ValueError("a gradient DTensor is Partial (unreduced); reduce it before the norm")
        dims = _shard_groups(g)
        local = g.to_local() if hasattr(g, "to_local") else g
        key = (id(getattr(g, "device_mesh", None)), dims) if dims else ()
        sq = local.float().pow(2).sum()
        sums[key] = sums[key] + sq if key in sums else sq
        if dims:
            meshes[key] = g.device_mesh
    total = torch.zeros((), dtype=torch.float32, device=next(iter(sums.values())).device)
    for key, s in sums.items():
        if key:
            for d in key[1]:
                dist.all_reduce(s, group=meshes[key].get_group(d))
        total = total + s
    return total.sqrt()


class AdamWLikeOptax:
    """`make_optimizer(optim, total_steps)` in PyTorch: clip by global norm, AdamW with the
    warmup + cosine schedule, no decay on the norm scales (parameters named `*norm.weight`)."""

    def __init__(self, named_params, optim: dict, total_steps: int):
        self.o = optim
        self.decay_steps = optim["decay_steps"] or total_steps
        decay, no_decay = [], []
        for name, p in named_params:
            (no_decay if name.endswith("norm.weight") else decay).append(p)
        self.params = decay + no_decay
        groups = [{"params": decay, "weight_decay": optim["weight_decay"]},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=0.0,
                                     betas=(optim["b1"], optim["b2"]), eps=optim["eps"])
        self.step_count = 0

    def lr(self, step: int) -> float:
        o = self.o
        return warmup_cosine_lr(step, o["lr"], o["warmup_steps"], self.decay_steps,
                                o["min_lr_ratio"])

    def step(self) -> float:
        """Clip, update, zero the gradients; returns the gradient norm before clipping."""
        norm = global_grad_norm(self.params)
        norm_f = float(norm)
        clip = self.o["clip_norm"]
        if clip > 0 and not norm_f < clip:
            coef = clip / norm_f
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        for g in self.opt.param_groups:
            g["lr"] = self.lr(self.step_count)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_count += 1
        return norm_f

    def state_bytes(self) -> int:
        """Bytes of the optimizer moments held by this rank (local shards)."""
        total = 0
        for st in self.opt.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    loc = v.to_local() if hasattr(v, "to_local") else v
                    total += loc.numel() * loc.element_size()
        return total
