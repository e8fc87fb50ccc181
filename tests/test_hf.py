"""Hugging Face interop: random tiny `LlamaForCausalLM`s and `MixtralForCausalLM`s built locally
load onto sharded meshes (expert parallel ones for Mixtral) with transformers' logits (1e-5), read
only per-device slices, export back bit for bit, and unsupported configs fail naming the field."""
import copy
import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxscale.axes import use_rules
from jaxscale.interop import hf, hf_config
from jaxscale.train.state import FunctionalModel
from tests.helpers import tiny_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {   # name: (LlamaConfig fields, mesh dp/fsdp/tp)
    "gqa": (dict(num_attention_heads=4, num_key_value_heads=2), (1, 4, 2)),
    "mqa": (dict(num_attention_heads=4, num_key_value_heads=1), (2, 4, 1)),
    "tied": (dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
             (1, 2, 4)),
    "llama3.1-rope": (dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling=LLAMA3,
                           rope_theta=50000.0), (2, 2, 2)),
    "head_dim": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24), (1, 8, 1)),
}


def make_hf_model(seed=0, **kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                max_position_embeddings=128, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    kw = copy.deepcopy(kw)          # LlamaConfig writes into the rope dict it is given
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**base, **kw})).eval()
    with torch.no_grad():           # non-trivial norm scales, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def jax_logits(loaded, tokens):
    model = FunctionalModel(loaded.cfg.model)

    def f(p, t):
        with use_rules(loaded.placement.mesh, loaded.placement.rules):
            return model.apply(p, t)
    return np.asarray(jax.jit(f)(loaded.params, tokens))


def mesh_cfg(dp, fsdp, tp, ep=1):
    return tiny_config(f"mesh.dp={dp}", f"mesh.fsdp={fsdp}", f"mesh.tp={tp}", f"mesh.ep={ep}")


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(name, tmp_path):
    kw, mesh = CASES[name]
    model = make_hf_model(**kw)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if name == "gqa" else "1GB")
    assert (tmp_path / hf.INDEX_FILE).exists() == (name == "gqa")
    loaded = hf.load(tmp_path, mesh_cfg(*mesh))
    assert loaded.cfg.model.tie_embeddings == (name == "tied")
    assert (loaded.cfg.model.rope_scaling is not None) == (name == "llama3.1-rope")
    tokens = np.random.default_rng(1).integers(0, 96, (2, 40))
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).logits.numpy()
    out = jax_logits(loaded, tokens)
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("name,scan", [("gqa", True), ("llama3.1-rope", False), ("tied", True)])
def test_export_reload_identical(tmp_path, name, scan):
    kw, mesh = CASES[name]
    model = make_hf_model(**kw)
    model.save_pretrained(tmp_path / "src")
    loaded = hf.load(tmp_path / "src", mesh_cfg(*mesh), scan_layers=scan)
    files = hf.export(tmp_path / "out", loaded.params, loaded.cfg.model, max_shard_bytes=60_000)
    assert (tmp_path / "out" / hf.INDEX_FILE) in files and len(files) > 3
    index = json.loads((tmp_path / "out" / hf.INDEX_FILE).read_text())
    tied = kw.get("tie_word_embeddings", False)
    assert set(index["weight_map"]) == {k for k in model.state_dict()
                                        if not (tied and k == "lm_head.weight")}
    again = hf.load(tmp_path / "out", mesh_cfg(2, 2, 2), scan_layers=scan)
    assert again.cfg.model == loaded.cfg.model
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    for k, v in model.state_dict().items():      # the exported tensors are transformers' own
        assert torch.equal(back.state_dict()[k], v), k
    tokens = torch.from_numpy(np.random.default_rng(2).integers(0, 96, (1, 40)))
    with torch.no_grad():                        # and so is the exported config (RoPE included)
        torch.testing.assert_close(back(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def test_reads_only_device_slices(tmp_path):
    make_hf_model(**CASES["gqa"][0]).save_pretrained(tmp_path)
    cfg = mesh_cfg(1, 8, 1)
    ckpt = hf.Checkpoint(tmp_path)
    model_cfg = hf_config.config_from_hf(ckpt.hf_config)
    from jaxscale import plan as plan_lib
    placement = plan_lib.place(dataclasses.replace(cfg, model=model_cfg))
    hf.load_params(ckpt, model_cfg, FunctionalModel(model_cfg).param_shardings(placement))
    assert ckpt.reads
    for name, shape in ckpt.reads:    # fsdp=8 shards every tensor on `embed`: an eighth at most
        assert np.prod(shape) * 8 <= np.prod(ckpt.shape(name)), (name, shape)


def test_bf16_checkpoint(tmp_path):
    model = make_hf_model(**CASES["mqa"][0]).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = hf.load(tmp_path, mesh_cfg(4, 2, 1))
    emb = np.asarray(loaded.params["embed"])
    assert emb.dtype == np.float32
    np.testing.assert_array_equal(emb, model.model.embed_tokens.weight.detach().float().numpy())


def test_transformers4_style_config():
    v4 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
          "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
          "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3.items()
                                                if k != "rope_type"}}}
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**LLAMA3, "rope_theta": 500000.0}
    a, b = hf_config.config_from_hf(v4), hf_config.config_from_hf(v5)
    assert a == b and a.rope_theta == 500000.0 and a.rope_scaling.original_max_position == 16
    assert hf_config.config_from_hf(hf_config.config_to_hf(a)) == a


@pytest.mark.parametrize("field,value,match", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type='yarn'"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type='dynamic'"),
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("model_type", "mistral", "model_type='mistral'"),
    ("architectures", ["GPT2LMHeadModel"], "architectures"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
])
def test_unsupported_config_named(field, value, match):
    cfg = hf_config.config_to_hf(tiny_config().model)
    cfg.pop("rope_parameters")
    cfg[field] = value
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace(".", r"\.")):
        hf_config.config_from_hf(cfg)


def test_biased_checkpoint_rejected(tmp_path):
    make_hf_model(num_attention_heads=4, num_key_value_heads=2,
                  attention_bias=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention_bias=true"):
        hf.load(tmp_path, mesh_cfg(4, 2, 1))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["attention_bias"] = False              # config lies: the tensors still give it away
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"no place for.*self_attn\.\w_proj\.bias"):
        hf.load(tmp_path, mesh_cfg(4, 2, 1))


def test_shape_mismatch_named(tmp_path):
    make_hf_model(**CASES["gqa"][0]).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        hf.load(tmp_path, mesh_cfg(4, 2, 1))


# ----------------------------------------------------------------------------- Mixtral
MIXTRAL = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, max_position_embeddings=128, rms_norm_eps=1e-5,
               router_aux_loss_coef=0.02)


def make_mixtral(seed=0, **kw):
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**{**MIXTRAL, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):      # a confident router: no near-ties in top-2
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    model = make_mixtral()
    model.save_pretrained(path, max_shard_size="100KB")       # indexed, several files
    tokens = np.random.default_rng(3).integers(0, MIXTRAL["vocab_size"], (8, 24))
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).logits.numpy()
    return path, model, tokens, ref


@pytest.mark.parametrize("mesh,scan", [((2, 1, 1, 4), True), ((1, 2, 2, 2), False),
                                       ((2, 2, 2, 1), True)])
def test_mixtral_logits_match_transformers(mixtral_dir, mesh, scan):
    path, _, tokens, ref = mixtral_dir
    assert (path / hf.INDEX_FILE).exists()
    loaded = hf.load(path, mesh_cfg(*mesh), scan_layers=scan)
    m = loaded.cfg.model
    assert (m.moe_experts, m.moe_top_k, m.moe_every, m.moe_dropless) == (4, 2, 1, True)
    assert m.moe_aux_weight == 0.01              # transformers' coefficient is top_k times ours
    assert loaded.placement.mesh.shape["ep"] == mesh[3]
    layers = loaded.params["layers"]
    w1 = np.asarray(layers["mlp"]["w_gate"])[1, 3] if scan else np.asarray(
        layers[1]["mlp"]["w_gate"])[3]           # layer 1, expert 3
    hf_w1 = hf.Checkpoint(path).read("model.layers.1.block_sparse_moe.experts.3.w1.weight",
                                     (slice(None),) * 2, np.float32)
    np.testing.assert_array_equal(w1, hf_w1.T)
    out = jax_logits(loaded, tokens)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    print(f"mixtral mesh={mesh} scan={scan}: max relative logit error {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("overrides", [
    ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=2", "mesh.ep=4", "plan.sequence_parallel=true"),
    ("mesh.dp=1", "mesh.fsdp=1", "mesh.sp=2", "mesh.tp=2", "mesh.ep=2")])
def test_mixtral_logits_on_split_sequences(mixtral_dir, overrides):
    """The grouped experts on a sequence split over devices (Megatron SP; context parallelism,
    whose zig-zag layout the step applies to the batch) give transformers' logits."""
    from jaxscale.strategies.sp.seq_layout import layout_permutation
    path, _, tokens, ref = mixtral_dir
    loaded = hf.load(path, tiny_config(*overrides))
    sp = loaded.placement.mesh.shape["sp"]
    perm = layout_permutation(tokens.shape[1], sp) if sp > 1 else np.arange(tokens.shape[1])
    model = FunctionalModel(loaded.cfg.model)

    def f(p, t, pos):
        with use_rules(loaded.placement.mesh, loaded.placement.rules):
            return model.apply(p, t, pos)
    pos = np.broadcast_to(perm, tokens.shape).astype(np.int32)
    out = np.asarray(jax.jit(f)(loaded.params, tokens[:, perm], pos))[:, np.argsort(perm)]
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5


def test_mixtral_export_reload_identical(mixtral_dir, tmp_path):
    path, model, tokens, ref = mixtral_dir
    loaded = hf.load(path, mesh_cfg(2, 1, 1, 4))
    files = hf.export(tmp_path, loaded.params, loaded.cfg.model, max_shard_bytes=60_000)
    assert (tmp_path / hf.INDEX_FILE) in files and len(files) > 3
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert config["router_aux_loss_coef"] == 0.02 and config["sliding_window"] is None
    index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(hf.Checkpoint(path).weight_map)
    again = hf.load(tmp_path, mesh_cfg(1, 2, 2, 2))
    assert again.cfg.model == loaded.cfg.model
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    with torch.no_grad():
        out = back(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_array_equal(out, ref)


def test_mixtral_config_mapping():
    hfc = transformers.MixtralConfig(**MIXTRAL).to_dict()
    hfc["architectures"] = ["MixtralForCausalLM"]
    cfg = hf_config.config_from_hf(hfc)
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.ffn_dim, cfg.moe_aux_weight) == (4, 2, 48, 0.01)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg
    # dense stays LLaMA
    assert hf_config.config_to_hf(tiny_config().model)["model_type"] == "llama"
    with pytest.raises(ValueError, match="sliding_window=4096"):
        hf_config.config_from_hf({**hfc, "sliding_window": 4096})
    with pytest.raises(ValueError, match="router_jitter_noise"):
        hf_config.config_from_hf({**hfc, "router_jitter_noise": 0.1})
    with pytest.raises(ValueError, match="model_type='llama'"):
        hf_config.config_from_hf({**hfc, "model_type": "llama"})
    with pytest.raises(ValueError, match="moe_every=2"):
        hf_config.config_to_hf(dataclasses.replace(cfg, moe_every=2, scan_layers=False))
