"""Matmul FLOPs of a parsed HLO module (`jaxscale.analysis.hlo.Module`), loop trip counts included.

XLA's `cost_analysis()` counts a while body once, whatever its trip count; here each matmul's
FLOPs of one execution are multiplied by its computation's run count (`Module.runs`). On XLA:CPU
the matmuls are `dot`s. XLA:GPU's spellings of matmuls that are no `dot` any more are read as
well: cuBLAS custom calls (`__cublas$gemm`, `__cublas$lt$matmul`, dimension numbers in
`gemm_backend_config`), Triton gemm fusions (a `dot` inside the computation of a `kind=kCustom`
fusion whose backend kind is `__triton_gemm`/`__triton_nested_gemm_fusion`, counted once, through
the fusion's run count) and cuDNN flash attention custom calls (`__cudnn$fmha*`, forward and
backward): `matmul_flops` gives them by source, `dot_flops` the sum.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict

from jaxscale.analysis.hlo import _CALLS, Instr, Module, _ints, shapes

MATMUL_SOURCES = ("dot", "triton_gemm", "cudnn_gemm", "cublas", "cudnn_attention")
_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul")          # prefixes: `$f8` variants included


def backend_config(ins: Instr) -> dict:
    """The instruction's `backend_config` as a dict (JSON, or the older JSON-in-a-string form)."""
    i = ins.rest.find("backend_config=")
    if i < 0:
        return {}
    try:
        cfg, _ = json.JSONDecoder().raw_decode(ins.rest, i + len("backend_config="))
        if isinstance(cfg, str):
            cfg = json.loads(cfg)
    except ValueError:
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _target(ins: Instr) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', ins.rest)
    return m.group(1) if m else ""


def _dnums(d: dict | None) -> dict[str, list[int]] | None:
    if not d:
        return None
    return {f"{side}_{what}": [int(x) for x in d.get(f"{side}_{what}_dimensions", [])]
            for side in ("lhs", "rhs") for what in ("batch", "contracting")}


def _array(shape_list) -> tuple[int, ...] | None:
    """The first array of an operand's or result's shapes (cuBLAS returns (output, workspace))."""
    arrays = [dims for _, dims in shape_list or () if dims]
    return arrays[0] if arrays else None


def _free(shape, dn, side) -> int:
    """Product of the dims of `shape` that are neither batch nor contracting on `side`."""
    skip = set(dn[f"{side}_batch"]) | set(dn[f"{side}_contracting"])
    return math.prod(n for d, n in enumerate(shape) if d not in skip)


def _gemm_flops(lhs, rhs, dn) -> float:
    """2 x batch x M x K (all of lhs) x N (rhs dims neither batch nor contracting)."""
    return 2.0 * math.prod(lhs) * _free(rhs, dn, "rhs")


def _fusion_kinds(module: Module) -> dict[str, str]:
    """Computation -> the backend kind (`__triton_gemm`, `__cudnn$fusion`, ...) of the kCustom
    fusion that calls it, inherited by the computations those call in turn."""
    kinds: dict[str, str] = {}
    for ins in module.instrs:
        if ins.opcode in ("fusion", "fusion-start") and "kind=kCustom" in ins.rest:
            kind = backend_config(ins).get("fusion_backend_config", {}).get("kind", "")
            m = re.search(r"\bcalls=%?([\w.\-]+)", ins.rest)
            if m and (kind or m.group(1).startswith("gemm_fusion")):
                kinds[m.group(1)] = kind or "__triton_gemm"
    callees = defaultdict(list)
    for ins in module.instrs:
        callees[ins.computation] += [c for _, c in _CALLS.findall(ins.rest)]
    stack = list(kinds)
    while stack:
        c = stack.pop()
        for callee in callees.get(c, ()):
            if callee not in kinds:
                kinds[callee] = kinds[c]
                stack.append(callee)
    return kinds


def _dot(module: Module, ins: Instr) -> float:
    ops = module.operand_shapes(ins)
    lhs = _array(ops[0]) if ops else None
    out = _array(shapes(ins.type_str))
    cm = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
    if lhs is None or out is None or not cm:
        return 0.0
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in _ints(cm.group(1)))


def _cublas(module: Module, ins: Instr) -> float:
    dn = _dnums(backend_config(ins).get("gemm_backend_config", {}).get("dot_dimension_numbers"))
    ops = module.operand_shapes(ins)
    lhs = _array(ops[0]) if ops else None
    rhs = _array(ops[1]) if len(ops) > 1 else None
    if dn is None or lhs is None:
        return 0.0
    if rhs is not None:
        return _gemm_flops(lhs, rhs, dn)
    out = _array(shapes(ins.type_str))       # (output, workspace): 2 x output x K
    return 2.0 * math.prod(out or ()) * math.prod(lhs[d] for d in dn["lhs_contracting"])


def _fmha(module: Module, ins: Instr) -> float:
    """cuDNN flash attention: Q K^T (2 x B x Hq x Sq x Sk x D) and P V (same with Dv) forward;
    backward recomputes Q K^T and does dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q
    (FlashAttention-2: 3 x D-sized + 2 x Dv-sized). Q, K, V are the first three operands in both;
    the FLOPs follow Q's heads (K/V may have fewer: GQA). A causal mask halves them, a sliding
    window of w keys keeps about w / Sk of them."""
    cfg = backend_config(ins).get("cudnn_fmha_backend_config", {})
    ops = [_array(o) for o in module.operand_shapes(ins)[:3]]
    if len(ops) < 3 or None in ops:
        return 0.0
    q, k, v = ops
    backward = "Backward" in _target(ins)
    if not backward and cfg.get("bmm1_dot_dimension_numbers") and \
            cfg.get("bmm2_dot_dimension_numbers"):
        bmm1 = _dnums(cfg["bmm1_dot_dimension_numbers"])        # S = Q K^T
        bmm2 = _dnums(cfg["bmm2_dot_dimension_numbers"])        # O = P V
        d = math.prod(q[i] for i in bmm1["lhs_contracting"])
        sk = _free(k, bmm1, "rhs")
        dv = _free(v, bmm2, "rhs")
    elif backward and cfg.get("bmm1_grad_gemm2_dot_dimension_numbers") and \
            cfg.get("bmm2_grad_gemm2_dot_dimension_numbers"):
        dq = _dnums(cfg["bmm1_grad_gemm2_dot_dimension_numbers"])    # dQ = dS K
        dp = _dnums(cfg["bmm2_grad_gemm2_dot_dimension_numbers"])    # dP = dO V^T
        d = _free(k, dq, "rhs")
        dv = math.prod(v[i] for i in dp["rhs_contracting"])
        sk = _free(v, dp, "rhs")
    else:                                   # no dimension numbers: [B, S, H, D] or [B, H, S, D]
        dims = cfg.get("intermediate_tensor_shape", {}).get("dimensions")
        if not dims:
            return 0.0
        d, dv, sk = q[-1], v[-1], int(dims[-1])
    scores = math.prod(q) // d * sk            # B x Hq x Sq x Sk
    flops = 2.0 * scores * ((3 * d + 2 * dv) if backward else (d + dv))
    keep = 0.5 if "CAUSAL" in str(cfg.get("mask_type", "")).upper() else 1.0
    window = int(cfg.get("sliding_window_length", 0) or 0)
    if window > 0:
        keep = min(keep, window / sk)
    return flops * keep


def matmuls(module: Module):
    """(source, instruction, FLOPs of one execution) for every matmul of the module, `source`
    one of MATMUL_SOURCES. A dot inside a Triton/cuDNN gemm fusion is reported once, as that
    fusion's source (its computation runs as often as the fusion does)."""
    kinds = None
    for ins in module.instrs:
        if ins.opcode == "dot":
            if kinds is None:
                kinds = _fusion_kinds(module)
            kind = kinds.get(ins.computation, "")
            src = ("triton_gemm" if kind.startswith("__triton") else
                   "cudnn_gemm" if kind.startswith("__cudnn") else "dot")
            yield src, ins, _dot(module, ins)
        elif ins.opcode in ("custom-call", "custom-call-start"):
            target = _target(ins)
            if target.startswith(_CUBLAS):
                yield "cublas", ins, _cublas(module, ins)
            elif target.startswith("__cudnn$fmha"):
                yield "cudnn_attention", ins, _fmha(module, ins)


def matmul_flops(module: Module) -> dict[str, float]:
    """Matmul FLOPs per step by source (MATMUL_SOURCES), each times its computation's run count."""
    out = dict.fromkeys(MATMUL_SOURCES, 0.0)
    for src, ins, f in matmuls(module):
        out[src] += f * module.runs.get(ins.computation, 0.0)
    return out


def dot_flops(module: Module) -> float:
    """All matmul FLOPs of the module per step (`dot`s on XLA:CPU; cuBLAS, Triton gemm fusions
    and cuDNN attention too on XLA:GPU), loop trip counts included."""
    return sum(matmul_flops(module).values())
