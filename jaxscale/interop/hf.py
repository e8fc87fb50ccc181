"""Hugging Face interop: `LlamaForCausalLM` and `MixtralForCausalLM` directories to sharded
jaxscale params and back.

Loading reads `config.json` (transformers 4 style `rope_theta` + `rope_scaling`, or transformers 5
style `rope_parameters`) into a `ModelConfig`, then builds every parameter with
`jax.make_array_from_callback`: each device's callback opens the safetensors file that holds the
tensor (`model.safetensors`, or the shard named by `model.safetensors.index.json`) and reads only
the slice that device owns (`safe_open(...).get_slice(name)[rows, cols]`), so no device and no host
buffer ever holds a whole sharded tensor. Stacked (scanned) layers are read layer by layer. The
tensor names and layouts, and the block reads, live in `jaxscale.interop.hf_tensors`.

Mixtral is the same model with a mixture of experts in every layer (`models/moe.py`; its router
and expert tensors are mapped in `hf_tensors`). The routing is the same (fp32 softmax over all
experts, top-k, renormalised); a loaded Mixtral is dropless (`model.moe_dropless`), so inference
is exact. Hugging Face's `router_aux_loss_coef` is k times `model.moe_aux_weight` (its
load-balancing loss is k times jaxscale's); a sliding window is refused.

Anything the jaxscale LLaMA cannot express fails with a `ValueError` naming the field or tensor:
another architecture or `model_type`, an activation other than SiLU, attention or MLP biases, a
`rope_scaling` type other than default/llama3, partial rotary embeddings, tensors with no place
in the model (or missing ones). Exporting writes `config.json` and safetensors, split into
`model-0000k-of-0000n.safetensors` files plus an index once the total passes `max_shard_bytes`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

# the config mapping, re-exported: callers convert configs through this module
from jaxscale.interop.hf_config import config_from_hf, config_to_hf
from jaxscale.interop.hf_tensors import (
    TensorMap,
    _bounds,
    _get,
    read_block,
    tensor_maps,
    to_hf_layout,
)
from jaxscale.models.llama import ModelConfig
from jaxscale.train import disk

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
#: tensors some checkpoints carry that are derived, not learned (RoPE tables)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_NUMPY_DTYPES = {"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"}


# ----------------------------------------------------------------------------- loading
def _read_json(path: Path) -> dict:
    """A JSON object from `path`; a broken file is a ValueError naming it, the line and column."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column "
                         f"{e.colno}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text (UTF-8) file: {e.reason}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class Checkpoint:
    """The safetensors files of a Hugging Face directory, read slice by slice. Every file is
    opened (its header read and checked against the file's size) when the checkpoint is, so a
    missing, truncated or corrupt file is a named error before any parameter is built."""

    def __init__(self, path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path}/config.json not found: not a Hugging Face "
                                    f"model directory")
        self.hf_config = _read_json(self.path / "config.json")
        self._files: dict[tuple, Any] = {}
        self.reads: list[tuple[str, tuple]] = []      # (name, shape read), for inspection
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: has no \"weight_map\" object (tensor name -> file)")
            self.weight_map = weight_map
        elif (self.path / SINGLE_FILE).is_file():
            self.weight_map = {n: SINGLE_FILE for n in self._open(SINGLE_FILE, "numpy").keys()}
        else:
            pickles = sorted(p.name for p in self.path.iterdir()
                             if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            hint = (f"; it holds {', '.join(pickles[:3])}{' ...' if len(pickles) > 3 else ''}: "
                    f"PyTorch pickle (.bin) files are not read, only safetensors. Convert once "
                    f"with transformers: LlamaForCausalLM.from_pretrained(dir).save_pretrained("
                    f"dir) writes {SINGLE_FILE} (transformers >= 4.35; before, pass "
                    f"safe_serialization=True)") if pickles else ""
            raise FileNotFoundError(f"{self.path} has neither {SINGLE_FILE} nor {INDEX_FILE}"
                                    f"{hint}")
        for file in sorted(set(self.weight_map.values())):
            if not (self.path / file).is_file():
                raise FileNotFoundError(f"{index} names {file}, which is not in {self.path}")
            self._open(file, "numpy")

    def _open(self, file: str, framework: str):
        from safetensors import safe_open
        key = (file, framework)
        if key not in self._files:
            try:
                self._files[key] = safe_open(str(self.path / file), framework=framework)
            except Exception as e:      # safetensors' SafetensorError: header, size, dtype
                if type(e).__name__ != "SafetensorError":
                    raise
                raise ValueError(f"{self.path / file}: not a readable safetensors file ({e}); "
                                 f"it is truncated or corrupt: download or export it "
                                 f"again") from None
        return self._files[key]

    def shape(self, name: str) -> tuple:
        return tuple(self._open(self.weight_map[name], "numpy").get_slice(name).get_shape())

    def read(self, name: str, slices: tuple, dtype) -> np.ndarray:
        sl = self._open(self.weight_map[name], "numpy").get_slice(name)
        if sl.get_dtype() not in _NUMPY_DTYPES:          # bf16 and friends: via ml_dtypes
            sl = self._open(self.weight_map[name], "flax").get_slice(name)
        x = np.asarray(sl[slices], dtype=dtype)
        self.reads.append((name, x.shape))
        return x

    def check_tensors(self, cfg: ModelConfig) -> None:
        expected = {m.hf_name for m in tensor_maps(cfg)}
        present = set(self.weight_map)
        extra = sorted(n for n in present - expected
                       if not n.endswith(IGNORED_SUFFIXES) and not (
                           cfg.tie_embeddings and n == "lm_head.weight"))
        if extra:
            raise ValueError(f"the checkpoint holds tensors jaxscale's LLaMA has no place for "
                             f"(biases? another architecture?): {', '.join(extra[:8])}"
                             f"{' ...' if len(extra) > 8 else ''}")
        missing = sorted(expected - present)
        if missing:
            raise ValueError(f"the checkpoint lacks {', '.join(missing[:8])}"
                             f"{' ...' if len(missing) > 8 else ''}")


def load_params(path_or_ckpt, cfg: ModelConfig, shardings) -> dict:
    """jaxscale params for `cfg` from a Hugging Face directory, each device reading its own slice.

    `shardings`: a tree of `jax.sharding.Sharding` matching the params (e.g.
    `FunctionalModel(cfg).param_shardings(plan)`), or one sharding for every parameter."""
    from jaxscale.train.state import FunctionalModel
    ckpt = path_or_ckpt if isinstance(path_or_ckpt, Checkpoint) else Checkpoint(path_or_ckpt)
    ckpt.check_tensors(cfg)
    abstract = FunctionalModel(cfg).abstract_params
    maps: dict[tuple, list[TensorMap]] = {}
    for m in tensor_maps(cfg):
        maps.setdefault(m.path, []).append(m)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, abstract)

    def build(path, leaf, sharding):
        ms = maps[path]
        dtype = np.dtype(leaf.dtype)
        n_lead = len(ms[0].lead)            # stacked axes: layers (scanned), experts
        per_layer = leaf.shape[n_lead:]
        by_lead = {m.lead: m for m in ms}
        for m in ms:
            want = to_hf_layout(m, np.empty(per_layer, np.int8)).shape
            got = ckpt.shape(m.hf_name)
            if tuple(got) != tuple(want):
                raise ValueError(f"tensor {m.hf_name} has shape {list(got)}, the config implies "
                                 f"{list(want)}")

        def callback(index):
            def one(lead):
                if len(lead) == n_lead:
                    m = by_lead[lead]
                    return read_block(m, lambda sl: ckpt.read(m.hf_name, sl, dtype),
                                      index[n_lead:])
                lo, hi = _bounds(index[len(lead)], leaf.shape[len(lead)])
                return np.stack([one(lead + (i,)) for i in range(lo, hi)])
            return one(())
        return jax.make_array_from_callback(leaf.shape, sharding, callback, dtype=dtype)

    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shard_leaves = jax.tree.leaves(shardings,
                                   is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    out = [build(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), leaf, sh)
           for (p, leaf), sh in zip(flat, shard_leaves)]
    return jax.tree.unflatten(treedef, out)


@dataclass
class Loaded:
    cfg: Any            # jaxscale.config.Config with the checkpoint's model
    placement: Any      # the mesh and rules the params are sharded for (jaxscale.plan.Placement)
    params: dict
    tokenizer: Any = None   # the directory's tokenizer (`jaxscale.data.tokenizer`), None if it
                            # has none


def load(path, cfg=None, devices=None, **model_overrides) -> Loaded:
    """Read a Hugging Face LLaMA or Mixtral directory onto the mesh of `cfg` (a
    `jaxscale.config.Config`; default: the default Config, i.e. its mesh preset, whose `ep` degree
    shards Mixtral's experts) with the plan's parameter shardings.
    `model_overrides` set jaxscale-only model fields (`scan_layers`, `attention`, `dtype`).
    A tokenizer.json / tokenizer.model in the directory becomes `Loaded.tokenizer` and
    `cfg.data.tokenizer`, checked against the model's vocabulary."""
    from jaxscale import plan as plan_lib
    from jaxscale.config import Config
    from jaxscale.data import tokenizer as tokenizer_lib
    from jaxscale.train.state import FunctionalModel
    ckpt = Checkpoint(path)
    cfg = cfg or Config()
    keep = {k: getattr(cfg.model, k) for k in ("scan_layers", "attention", "dtype", "param_dtype")}
    model_cfg = config_from_hf(ckpt.hf_config, **{**keep, **model_overrides})
    cfg = dataclasses.replace(cfg, model=model_cfg)
    tok = tokenizer_lib.from_directory(path)
    if tok is not None:
        bad = tokenizer_lib.vocab_problem(tok.vocab_size, model_cfg.vocab_size, str(tok.path))
        if bad:
            raise ValueError(f"{path}: config.json's vocab_size {model_cfg.vocab_size} is smaller "
                             f"than its tokenizer's vocabulary ({tok.vocab_size}): {bad}")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(tok.path)))
    placement = plan_lib.place(cfg, devices)
    # read at the file's vocabulary (whole along it), then padded as the plan pads it
    model = FunctionalModel(placement.spec.model)
    padded = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          model.abstract_params, model.param_shardings(placement))
    true = disk.disk_abstract(padded, model_cfg.vocab_size)
    params = load_params(ckpt, model_cfg, jax.tree.map(lambda a: a.sharding, true))
    return Loaded(cfg, placement, disk.from_disk(params, padded), tok)


# ----------------------------------------------------------------------------- export
def _host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def export(path, params, cfg: ModelConfig, dtype: str = "float32",
           max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write `params` as a Hugging Face LLaMA (dense) or Mixtral (mixture of experts) directory;
    returns the files written.

    Tensors come to the host one at a time (one layer of a scanned stack at a time) and are
    written file by file, so the host holds at most one output file's worth. Above
    `max_shard_bytes` in total the weights are split into numbered files plus
    `model.safetensors.index.json`.
    Multi-process: every process must call this (the gathers are collective); process 0 writes."""
    import ml_dtypes
    from safetensors.numpy import save_file
    out = Path(path)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    params = disk.to_disk(params, cfg.vocab_size)      # a plan's vocabulary padding left out
    maps = tensor_maps(cfg)
    sizes = []
    for m in maps:
        leaf = _get(params, m.path)
        n = math.prod(leaf.shape[len(m.lead):])
        sizes.append(n * np_dtype.itemsize)
    groups: list[list[int]] = [[]]
    acc = 0
    for i, b in enumerate(sizes):
        if groups[-1] and acc + b > max_shard_bytes:
            groups.append([])
            acc = 0
        groups[-1].append(i)
        acc += b
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype), indent=2) + "\n")
    names = [SINGLE_FILE] if len(groups) == 1 else [
        f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        tensors = {}
        for i in group:
            m = maps[i]
            leaf = _get(params, m.path)
            x = _host(leaf[m.lead] if m.lead else leaf)   # one layer (or expert) on the host
            tensors[m.hf_name] = np.ascontiguousarray(to_hf_layout(m, x).astype(np_dtype))
            weight_map[m.hf_name] = name
        if writer:
            save_file(tensors, str(out / name), metadata={"format": "pt"})
    files = [out / "config.json"] + [out / n for n in names]
    if writer and len(names) > 1:
        (out / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}, indent=2))
        files.append(out / INDEX_FILE)
    return files
