"""The HLO reader on XLA:GPU programs: cuBLAS / Triton / cuDNN matmul FLOPs and async collectives.

The fixture is the optimized HLO of one training step on one H200 (jax 0.11.2), see
`shared/gpu/README.md`: LLaMA dim 2048, 12 layers, 16 heads (head_dim 128), 8 kv heads, ffn 5632,
vocab 320, seq 2048, batch 8 (16,384 tokens), bf16, causal attention through cuDNN, layers in a
`scan` (two while loops with known_trip_count 12).
"""
import functools
import gzip
import pathlib
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxscale.analysis import hlo, hlo_flops, inspect
from jaxscale.models.llama import ModelConfig

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "h200_train_step_0p57b.hlo.txt.gz"
B, S, L, H, KV, D = 8, 2048, 12, 16, 8, 128


@functools.lru_cache(maxsize=None)
def _text() -> str:
    with gzip.open(FIXTURE, "rt") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def _module() -> hlo.Module:
    return hlo.Module(_text())


def _formula() -> float:
    cfg = ModelConfig(vocab_size=320, dim=2048, n_layers=L, n_heads=H, n_kv_heads=KV, ffn_dim=5632,
                      max_seq_len=S)
    return cfg.flops_per_token(S, causal=True) * B * S


# ----------------------------------------------------------------------------- matmul FLOPs
def test_h200_matmul_flops_match_the_model_formula():
    mod = _module()
    assert mod.runs["region_1.22.clone.clone"] == L and mod.runs["region_18.66.clone.clone"] == L
    total = hlo_flops.dot_flops(mod)
    assert abs(total / _formula() - 1) < 0.02
    # The remaining +1.36% is real work the formula leaves out: cuDNN's backward recomputes the
    # scores Q K^T (FlashAttention-2: 5 matmuls backward against the formula's 4), one causal
    # B x H x S x S x D matmul per layer. Without it the HLO and the formula agree to 1e-4:
    # every projection, MLP and LM-head matmul is there forward, dgrad and wgrad.
    recompute = L * 2 * B * H * S * S * D / 2
    assert abs((total - recompute) / _formula() - 1) < 1e-4


def test_h200_breakdown_by_source():
    got = hlo_flops.matmul_flops(_module())
    assert set(got) == set(hlo_flops.MATMUL_SOURCES)
    assert got["cublas"] > 0 and got["triton_gemm"] > 0 and got["cudnn_attention"] > 0
    assert got["dot"] == 0 and got["cudnn_gemm"] == 0      # every dot here is in a gemm fusion
    # cuBLAS runs the rest: the formula plus cuDNN's score recompute, less the other sources
    recompute = L * 2 * B * H * S * S * D / 2
    assert got["cublas"] == pytest.approx(
        _formula() + recompute - got["cudnn_attention"] - got["triton_gemm"], rel=1e-4)
    # attention: forward 2 + backward 5 causal (halved) matmuls of B x Hq x S x S x D per layer,
    # Hq = 16 query heads although K/V have 8 (GQA)
    assert got["cudnn_attention"] == pytest.approx(L * 7 * 2 * B * H * S * S * D / 2, rel=1e-12)
    # Triton gemm fusions: two [2048,2048] weight gradients per layer (K=16384) and the LM head's
    # input gradient and split-K weight gradient once
    assert got["triton_gemm"] == pytest.approx(2 * L * 2 * 2048 * 2048 * B * S
                                               + 2 * 2 * B * S * 2048 * 320, rel=1e-12)


def test_h200_each_matmul_counted_once():
    mod = _module()
    found = [(src, ins.name) for src, ins, _ in hlo_flops.matmuls(mod)]
    assert len(found) == len(set(found))
    by_src = {s: sum(1 for x, _ in found if x == s) for s in hlo_flops.MATMUL_SOURCES}
    # 18 cuBLAS calls, 4 dots in 4 gemm fusions, 1 cuDNN forward + 1 backward
    assert by_src == {"dot": 0, "triton_gemm": 4, "cudnn_gemm": 0, "cublas": 18,
                      "cudnn_attention": 2}
    n_fusions = len(re.findall(r"kind=kCustom, calls=%gemm_fusion_dot", _text()))
    assert n_fusions == by_src["triton_gemm"]


def test_h200_cudnn_shapes_agree_with_the_score_tensor():
    """The scores B x Hq x Sq x Sk that cuDNN reports equal those read from Q/K/V and the bmm
    dimension numbers; a non-causal mask doubles the FLOPs."""
    mod = _module()
    for _, ins, f in (m for m in hlo_flops.matmuls(mod) if m[0] == "cudnn_attention"):
        cfg = hlo_flops.backend_config(ins)["cudnn_fmha_backend_config"]
        assert [int(x) for x in cfg["intermediate_tensor_shape"]["dimensions"]] == [B, H, S, S]
        assert cfg["mask_type"] == "CAUSAL"
        n = 5 if "Backward" in ins.rest else 2
        assert f == n * 2 * B * H * S * S * D / 2
        line = next(x for x in _text().splitlines() if f"%{ins.name} = " in x)
        # the same call without a causal mask, and with no dimension numbers at all
        for edit in (lambda t: t.replace('"mask_type":"CAUSAL"', '"mask_type":"NO_MASK"'),
                     lambda t: re.sub(r'"bmm\w*_dot_dimension_numbers"', '"x"', t)):
            text = _text().replace(line, edit(line))
            mod2 = hlo.Module(text)
            f2 = [g for _, i, g in hlo_flops.matmuls(mod2) if i.name == ins.name][0]
            assert f2 == (2 * f if "NO_MASK" in edit(line) else f)


def test_cublas_batched_gemm_and_inline_operand_types():
    text = """HloModule m

ENTRY %main (a: f32[4,32,64], b: f32[4,64,16]) -> f32[4,32,16] {
  %a = f32[4,32,64]{2,1,0} parameter(0)
  %b = f32[4,64,16]{2,1,0} parameter(1)
  %gemm = (f32[4,32,16]{2,1,0}, s8[1024]{0}) custom-call(f32[4,32,64]{2,1,0} %a, %b), \
custom_call_target="__cublas$gemm", \
backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":["0"],\
"lhs_contracting_dimensions":["2"],"rhs_batch_dimensions":["0"],\
"rhs_contracting_dimensions":["1"]}}}
  ROOT %out = f32[4,32,16]{2,1,0} get-tuple-element(%gemm), index=0
}
"""
    got = hlo_flops.matmul_flops(hlo.Module(text))
    assert got["cublas"] == 2 * 4 * 32 * 16 * 64
    assert hlo_flops.dot_flops(hlo.Module(text)) == 2 * 4 * 32 * 16 * 64


def test_cpu_dots_unchanged():
    """XLA:CPU: plain dots, one inside a scan (trip count 3), counted as before."""
    def f(x, w):
        def body(c, _):
            return c @ w, None
        return jax.lax.scan(body, x, None, length=3)[0] @ w.T
    x = jax.ShapeDtypeStruct((16, 32), np.float32)
    w = jax.ShapeDtypeStruct((32, 32), np.float32)
    text = jax.jit(f).lower(x, w).compile().as_text()
    got = hlo_flops.matmul_flops(hlo.Module(text))
    assert got["dot"] == 4 * 2 * 16 * 32 * 32
    assert hlo_flops.dot_flops(hlo.Module(text)) == 4 * 2 * 16 * 32 * 32


# ----------------------------------------------------------------------------- async collectives
_ADD = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""
_G = "replica_groups={{0,1,2,3,4,5,6,7}}"


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))


def _census(text):
    return {r["kind"]: (r["count"], r["bytes"], r["axes"]) for r in inspect.census(text, _mesh())}


def test_dedicated_async_collectives_counted_at_start():
    """XLA:GPU's own pairs: all-reduce-start/-done, all-gather-start/-done,
    collective-permute-start/-done."""
    text = f"""HloModule m

{_ADD}
ENTRY %main (p: f32[1024]) -> f32[1024] {{
  %p = f32[1024]{{0}} parameter(0)
  %ars = f32[1024]{{0}} all-reduce-start(%p), channel_id=1, {_G}, use_global_device_ids=true, \
to_apply=%add
  %ard = f32[1024]{{0}} all-reduce-done(%ars)
  %sl = f32[128]{{0}} slice(%ard), slice={{[0:128]}}
  %ags = (f32[128]{{0}}, f32[1024]{{0}}) all-gather-start(%sl), channel_id=2, {_G}, \
dimensions={{0}}, use_global_device_ids=true
  %agd = f32[1024]{{0}} all-gather-done(%ags)
  %cps = (f32[1024]{{0}}, f32[1024]{{0}}, u32[], u32[]) collective-permute-start(%agd), \
channel_id=3, \
source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,0}},{{4,5}},{{5,6}},{{6,7}},{{7,4}}}}
  ROOT %cpd = f32[1024]{{0}} collective-permute-done(%cps)
}}
"""
    got = _census(text)
    assert got == {"all-reduce": (1, 4096, ["dp", "tp"]), "all-gather": (1, 4096, ["dp", "tp"]),
                   "collective-permute": (1, 4096, ["tp"])}


def test_async_wrapped_collectives_counted_once():
    """Unsugared generic async ops: the collective lives in the wrapped computation, run once per
    async-start, also when async-done repeats `calls=` (older spelling) and inside a loop."""
    text = f"""HloModule m

{_ADD}
%wrapped_all_reduce (a: f32[1024]) -> f32[1024] {{
  %a = f32[1024]{{0}} parameter(0)
  ROOT %ar = f32[1024]{{0}} all-reduce(%a), channel_id=1, {_G}, use_global_device_ids=true, \
to_apply=%add
}}, execution_thread="parallel"

%wrapped_reduce_scatter (a: f32[1024]) -> f32[128] {{
  %a.1 = f32[1024]{{0}} parameter(0)
  ROOT %rs = f32[128]{{0}} reduce-scatter(%a.1), channel_id=2, {_G}, dimensions={{0}}, \
use_global_device_ids=true, to_apply=%add
}}, execution_thread="parallel"

%wrapped_all_to_all (a: f32[1024]) -> f32[1024] {{
  %a.2 = f32[1024]{{0}} parameter(0)
  ROOT %a2a = f32[1024]{{0}} all-to-all(%a.2), channel_id=3, \
replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, dimensions={{0}}
}}, execution_thread="parallel"

%body (c: (s32[], f32[1024])) -> (s32[], f32[1024]) {{
  %c = (s32[], f32[1024]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %v = f32[1024]{{0}} get-tuple-element(%c), index=1
  %s1 = ((f32[1024]{{0}}), f32[1024]{{0}}, u32[]) async-start(%v), \
async_execution_thread="parallel", calls=%wrapped_all_to_all
  %u1 = ((f32[1024]{{0}}), f32[1024]{{0}}, u32[]) async-update(%s1), \
async_execution_thread="parallel", calls=%wrapped_all_to_all
  %d1 = f32[1024]{{0}} async-done(%u1), async_execution_thread="parallel", calls=%wrapped_all_to_all
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[1024]{{0}}) tuple(%j, %d1)
}}

%cond (c: (s32[], f32[1024])) -> pred[] {{
  %c.1 = (s32[], f32[1024]{{0}}) parameter(0)
  %i.1 = s32[] get-tuple-element(%c.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}}

ENTRY %main (p: f32[1024]) -> f32[128] {{
  %p = f32[1024]{{0}} parameter(0)
  %s0 = ((f32[1024]{{0}}), f32[1024]{{0}}, u32[]) async-start(%p), \
async_execution_thread="parallel", calls=%wrapped_all_reduce
  %d0 = f32[1024]{{0}} async-done(%s0), async_execution_thread="parallel", calls=%wrapped_all_reduce
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[1024]{{0}}) tuple(%zero, %d0)
  %w = (s32[], f32[1024]{{0}}) while(%t0), condition=%cond, body=%body, \
backend_config={{"known_trip_count":{{"n":"3"}}}}
  %v0 = f32[1024]{{0}} get-tuple-element(%w), index=1
  %s2 = ((f32[1024]{{0}}), f32[128]{{0}}, u32[]) async-start(%v0), \
async_execution_thread="parallel", calls=%wrapped_reduce_scatter
  ROOT %d2 = f32[128]{{0}} async-done(%s2)
}}
"""
    mod = hlo.Module(text)
    assert mod.runs["wrapped_all_reduce"] == 1 and mod.runs["wrapped_all_to_all"] == 3
    got = _census(text)
    assert got == {"all-reduce": (1, 4096, ["dp", "tp"]), "reduce-scatter": (1, 4096, ["dp", "tp"]),
                   "all-to-all": (3, 3 * 4096, ["tp"])}


def test_sugared_async_collectives_counted_at_start():
    """The same generic async ops printed with syntax sugar: `reduce-scatter-start`/-update/-done,
    whose start result is ((operands), output, context)."""
    text = f"""HloModule m

{_ADD}
ENTRY %main (p: f32[1024]) -> f32[1024] {{
  %p = f32[1024]{{0}} parameter(0)
  %rss = ((f32[1024]{{0}}), f32[128]{{0}}, u32[]) reduce-scatter-start(%p), \
async_execution_thread="parallel", channel_id=1, {_G}, dimensions={{0}}, \
use_global_device_ids=true, to_apply=%add
  %rsu = ((f32[1024]{{0}}), f32[128]{{0}}, u32[]) reduce-scatter-update(%rss)
  %rsd = f32[128]{{0}} reduce-scatter-done(%rsu)
  %a2s = ((f32[1024]{{0}}), f32[1024]{{0}}) all-to-all-start(%p), \
async_execution_thread="parallel", channel_id=2, \
replica_groups={{{{0,4}},{{1,5}},{{2,6}},{{3,7}}}}, dimensions={{0}}
  ROOT %a2d = f32[1024]{{0}} all-to-all-done(%a2s)
}}
"""
    got = _census(text)
    assert got == {"reduce-scatter": (1, 4096, ["dp", "tp"]), "all-to-all": (1, 4096, ["dp"])}
