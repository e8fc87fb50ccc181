"""The PyTorch baselines compute the same thing: logits on converted weights, and 10 training steps
of DP vs DDP, FSDP vs FSDP2 and TP vs DTensor TP as real 2-process gloo jobs.

Loss tolerance: 2e-5 nats (absolute) at every step. Both sides run fp32; what differs is the order
of reductions (XLA's fused matmuls and all-reduces against torch's kernels and gloo's ring), which
gave at most 1.5e-6 over 10 steps here. The smallest optimizer mismatch tried, dropping weight
decay (0.1, lr 1e-3), moves the step-10 loss by 2.4e-4; a one-step shift of the schedule or a
different Adam beta moves it by more than 1e-3. So 2e-5 leaves 10x room for rounding and still
tells a different optimizer, schedule or data order from rounding.
"""
import dataclasses
import math

import jax
import numpy as np
import pytest
import torch

from benchmarks import torch_llama as tl
from jaxscale.benchmarks.matched_training import run_pairs
from jaxscale.models.llama import RopeScaling
from jaxscale.train.state import FunctionalModel, make_optimizer
from tests.helpers import tiny_config

LOSS_ATOL = 2e-5


@pytest.mark.parametrize("kw", [
    {}, {"scan_layers": False, "n_kv_heads": 1, "tie_embeddings": True},
    {"rope_scaling": RopeScaling(original_max_position=16), "head_dim": 24},
], ids=["gqa", "mqa-tied-unscanned", "llama3.1-rope-head_dim"])
def test_torch_llama_logits_match(kw):
    cfg = dataclasses.replace(tiny_config().model, **kw)
    model = FunctionalModel(cfg)
    params = jax.jit(model.init)(jax.random.key(3))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
    ref = np.asarray(jax.jit(model.apply)(params, tokens))
    net = tl.TorchLlama(tl.TorchLlamaConfig.from_model_config(cfg))
    net.load_state_dict(tl.state_dict_from_jaxscale(params, cfg))
    with torch.no_grad():
        out = net(torch.from_numpy(tokens)).numpy()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5
    back = tl.jaxscale_from_state_dict(net.state_dict(), cfg)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_schedule_matches_optax():
    cfg = tiny_config("optim.warmup_steps=5", "optim.lr=2e-3", "optim.min_lr_ratio=0.1",
                      "optim.decay_steps=0")          # the decay over the run's steps
    for total in (3, 5, 6, 40):
        _, schedule = make_optimizer(cfg.optim, total)
        for step in range(total + 3):
            mine = tl.warmup_cosine_lr(step, 2e-3, 5, total, 0.1)
            assert math.isclose(mine, float(schedule(step)), rel_tol=1e-6, abs_tol=1e-12), (
                total, step)


def test_optimizer_step_matches_optax():
    """One clipped AdamW step on a plain module, torch vs optax, from the same gradients."""
    import optax
    cfg = tiny_config("optim.clip_norm=0.5", "optim.warmup_steps=0")
    opt, _ = make_optimizer(cfg.optim, 10)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32),
              "norm": {"scale": rng.normal(size=(3,)).astype(np.float32)}}
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    state = opt.init(params)
    new = params
    for _ in range(2):
        upd, state = opt.update(grads, state, new)
        new = optax.apply_updates(new, upd)
    w = torch.nn.Parameter(torch.from_numpy(params["w"].copy()))
    s = torch.nn.Parameter(torch.from_numpy(params["norm"]["scale"].copy()))
    topt = tl.AdamWLikeOptax([("w", w), ("final_norm.weight", s)],
                             dataclasses.asdict(cfg.optim), 10)
    for _ in range(2):
        w.grad = torch.from_numpy(grads["w"].copy())
        s.grad = torch.from_numpy(grads["norm"]["scale"].copy())
        norm = topt.step()
    assert norm == pytest.approx(float(optax.tree.norm(grads)), rel=1e-6)
    np.testing.assert_allclose(w.detach().numpy(), np.asarray(new["w"]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s.detach().numpy(), np.asarray(new["norm"]["scale"]), rtol=1e-6,
                               atol=1e-7)


@pytest.fixture(scope="module")
def matched():
    cfg = tiny_config()            # n_layers 2, seq 32, global batch 8, lr 1e-3 from step 0
    results = run_pairs(["dp", "fsdp", "tp"], cfg, world=2, steps=10, warmup=1, chunk=3,
                        timeout=600)        # a guard against a hang, not a speed check
    return {r["pair"]: r for r in results}


@pytest.mark.parametrize("pair", ["dp", "fsdp", "tp"])
def test_matched_training_losses_agree(matched, pair):
    r = matched[pair]
    jl, tl_ = np.array(r["jax"]["loss"]), np.array(r["torch"]["loss"])
    assert len(jl) == len(tl_) == 10
    assert jl[-1] < jl[0] - 0.5                     # it trains
    np.testing.assert_allclose(tl_, jl, rtol=0, atol=LOSS_ATOL)
    np.testing.assert_allclose(r["torch"]["grad_norm"], r["jax"]["grad_norm"], rtol=1e-4)
    assert r["jax"]["tokens_per_s"] > 0 and r["torch"]["tokens_per_s"] > 0


def test_matched_training_memory_accounting(matched):
    n_params = tiny_config().model.param_count()
    full_state = 3 * 4 * n_params                    # fp32 params + two Adam moments
    dp, fsdp, tp = matched["dp"], matched["fsdp"], matched["tp"]
    assert dp["torch"]["state_bytes_per_rank"] == [full_state] * 2
    assert dp["jax"]["state_bytes_per_device"] == pytest.approx(full_state, rel=1e-3)
    for r in (fsdp, tp):      # sharded two ways: half the state per rank on both sides
        for b in r["torch"]["state_bytes_per_rank"]:
            assert b == pytest.approx(full_state / 2, rel=0.02)
        assert r["jax"]["state_bytes_per_device"] == pytest.approx(full_state / 2, rel=0.02)
    for r in (dp, fsdp, tp):
        assert all(p >= s for p, s in zip(r["torch"]["peak_bytes_per_rank"],
                                          r["torch"]["state_bytes_per_rank"]))
        assert r["jax"]["peak_bytes_per_device"] >= r["jax"]["state_bytes_per_device"]


def test_unsupported_pair_is_named():
    with pytest.raises(ValueError, match="n_kv_heads=4 is not divisible by mesh.tp=8"):
        run_pairs(["tp"], tiny_config(), world=8, steps=2)
