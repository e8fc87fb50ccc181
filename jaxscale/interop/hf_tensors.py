"""Hugging Face <-> jaxscale tensors: every `LlamaForCausalLM` / `MixtralForCausalLM` tensor name,
the jaxscale parameter (or layer, or expert, of it) it becomes, and the layout conversion both
ways, a device's block read through only the Hugging Face rows and columns it needs.

Layout: Hugging Face `nn.Linear` weights are [out, in]; jaxscale keeps [in, heads, head_dim] for
Q/K/V, [heads, head_dim, out] for the attention output and [in, out] for the rest. The rotary
layout is the same on both sides (rotate-half: pairs (x[i], x[i + d/2])), so Q and K need no
permutation, only the reshape and transpose above.

Mixtral (a mixture of experts in every layer, `models/moe.py`): per layer
`block_sparse_moe.gate.weight` [E, dim] is `mlp/router` transposed and `experts.<e>.w1/w3/w2`
are expert e of `mlp/w_gate`/`w_up`/`w_down`, each transposed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxscale.models.llama import ModelConfig


@dataclass(frozen=True)
class TensorMap:
    """One Hugging Face tensor and the jaxscale parameter (or layer of it) it becomes.

    kind: `same` (identical layout), `t` (2-D transpose), `qkv` ([n*hd, d] <-> [d, n, hd]),
    `o` ([d, n*hd] <-> [n, hd, d])."""
    hf_name: str
    path: tuple          # keys into the params dict (an int layer key when not scanned)
    layer: int | None    # the index into the leading layers axis when scanned
    kind: str
    heads: int = 0
    head_dim: int = 0
    expert: int | None = None   # the index into the experts axis (after `layers`) of an expert

    @property
    def lead(self) -> tuple:
        """The indices into the leading (stacking) axes: layer when scanned, then expert."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def tensor_maps(cfg: ModelConfig) -> list[TensorMap]:
    maps = [TensorMap("model.embed_tokens.weight", ("embed",), None, "same"),
            TensorMap("model.norm.weight", ("norm", "scale"), None, "same")]
    if not cfg.tie_embeddings:
        maps.append(TensorMap("lm_head.weight", ("head",), None, "t"))
    hd = cfg.hd
    for i in range(cfg.n_layers):
        pre, base = f"model.layers.{i}.", (("layers",) if cfg.scan_layers else ("layers", i))
        layer = i if cfg.scan_layers else None
        for name, key, kind, n in (
                ("self_attn.q_proj", ("attn", "wq"), "qkv", cfg.n_heads),
                ("self_attn.k_proj", ("attn", "wk"), "qkv", cfg.n_kv_heads),
                ("self_attn.v_proj", ("attn", "wv"), "qkv", cfg.n_kv_heads),
                ("self_attn.o_proj", ("attn", "wo"), "o", cfg.n_heads),
                ("input_layernorm", ("attn_norm", "scale"), "same", 0),
                ("post_attention_layernorm", ("mlp_norm", "scale"), "same", 0)):
            maps.append(TensorMap(pre + name + ".weight", base + key, layer, kind, n, hd))
        if not cfg.is_moe_layer(i):
            for name, key in (("gate_proj", "w_gate"), ("up_proj", "w_up"),
                              ("down_proj", "w_down")):
                maps.append(TensorMap(f"{pre}mlp.{name}.weight", base + ("mlp", key), layer, "t"))
            continue
        moe = pre + "block_sparse_moe."
        maps.append(TensorMap(moe + "gate.weight", base + ("mlp", "router"), layer, "t"))
        for e in range(cfg.moe_experts):
            for name, key in (("w1", "w_gate"), ("w3", "w_up"), ("w2", "w_down")):
                maps.append(TensorMap(f"{moe}experts.{e}.{name}.weight", base + ("mlp", key),
                                      layer, "t", expert=e))
    return maps


def to_hf_layout(m: TensorMap, x: np.ndarray) -> np.ndarray:
    """One layer's jaxscale array -> the Hugging Face tensor."""
    if m.kind == "same":
        return x
    if m.kind == "t":
        return x.T
    if m.kind == "qkv":
        return x.reshape(x.shape[0], m.heads * m.head_dim).T
    return x.reshape(m.heads * m.head_dim, x.shape[-1]).T        # "o"


def _bounds(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError(f"shard slices must be contiguous, got step {step}")
    return start, stop


def read_block(m: TensorMap, read: Callable[[tuple], np.ndarray], index: tuple) -> np.ndarray:
    """The block `index` (slices over one layer's jaxscale shape) of a parameter, reading only the
    Hugging Face rows and columns it needs through `read(hf_slices)`."""
    if m.kind == "same":
        return read(tuple(index))
    if m.kind == "t":
        return read((index[1], index[0])).T
    hd = m.head_dim
    if m.kind == "qkv":              # jax [d, n, k] <- hf [n*hd, d]
        (n0, n1) = _bounds(index[1], m.heads)
        rows = read((slice(n0 * hd, n1 * hd), index[0]))             # [(n1-n0)*hd, d]
        x = rows.reshape(n1 - n0, hd, rows.shape[-1])[:, index[2], :]
        return x.transpose(2, 0, 1)
    (n0, n1) = _bounds(index[0], m.heads)   # "o": jax [n, k, d] <- hf [d, n*hd]
    cols = read((index[2], slice(n0 * hd, n1 * hd)))                 # [d, (n1-n0)*hd]
    x = cols.reshape(cols.shape[0], n1 - n0, hd)[:, :, index[1]]
    return x.transpose(1, 2, 0)


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def params_to_hf(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Host copy of a (small) params dict in Hugging Face names and layout."""
    out = {}
    for m in tensor_maps(cfg):
        x = np.asarray(_get(params, m.path))
        out[m.hf_name] = np.ascontiguousarray(to_hf_layout(m, x[m.lead]))
    return out


def hf_to_params(tensors: dict, cfg: ModelConfig) -> dict:
    """Hugging Face named arrays -> a jaxscale params dict of numpy arrays (host memory)."""
    params: dict = {}
    by_path: dict[tuple, list] = {}
    for m in tensor_maps(cfg):
        if m.hf_name not in tensors:
            raise ValueError(f"tensor {m.hf_name} is missing")
        t = np.asarray(tensors[m.hf_name])
        full = (slice(None),) * {"same": t.ndim, "t": 2, "qkv": 3, "o": 3}[m.kind]
        x = read_block(m, lambda sl, t=t: t[sl], full)
        by_path.setdefault(m.path, []).append((m.lead, x))
    for path, xs in by_path.items():
        node = params
        for k in path[:-1]:
            node = node.setdefault(k, {})
        xs.sort(key=lambda kx: kx[0])
        lead = tuple(n + 1 for n in xs[-1][0])         # the stacked axes' sizes
        node[path[-1]] = np.stack([x for _, x in xs]).reshape(lead + xs[0][1].shape)
    return params
