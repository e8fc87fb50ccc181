"""Read a compiled (SPMD-partitioned) HLO module: collectives, their replica groups, loop counts, dots.

What the census needs from `compiled.as_text()`:
- every collective instruction (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute, and their async `-start` forms), its per-device result bytes and the device
  groups it runs over, in any of XLA's spellings: explicit `{{0,1},{2,3}}`, iota
  `[4,2]<=[2,4]T(1,0)`, or mesh form `mesh['axis_0'=4,'axis_1'=2] {'axis_1'}` (with optional
  `device_ids=(...)`), and `source_target_pairs` for permutes;
- how many times each computation runs: a `while` body runs `known_trip_count` times per
  execution of its caller (a scan over layers puts one layer's collectives in such a body), so
  counts and bytes are multiplied along the call graph from ENTRY;
- dot instructions with their shapes, for matmul FLOPs (XLA's `cost_analysis()` counts a while
  body once, whatever its trip count).

XLA:GPU spellings read here as well:
- matmuls that are no `dot` any more: cuBLAS custom calls (`__cublas$gemm`, `__cublas$lt$matmul`,
  dimension numbers in `gemm_backend_config`), Triton gemm fusions (a `dot` inside the computation
  of a `kind=kCustom` fusion whose backend kind is `__triton_gemm`/`__triton_nested_gemm_fusion`,
  counted once, through the fusion's run count) and cuDNN flash attention custom calls
  (`__cudnn$fmha*`, forward and backward): `matmul_flops` gives them by source, `dot_flops` the sum;
- async forms: `all-reduce-start`/`-done` style pairs and their sugared generic spelling
  (`reduce-scatter-start`, `fusion-start`, ...): counted at the `-start`, never at `-update` or
  `-done`; and unsugared `async-start(...), calls=%wrapped`: counted in the wrapped computation,
  which runs once per `async-start` (a `calls=` on `async-update`/`async-done` is no other run).
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(pred|[subfc]\d+|f8e\w+|bf16)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclass
class Instr:
    name: str
    type_str: str
    opcode: str
    rest: str
    computation: str


def shapes(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _SHAPE.findall(type_str)]


def nbytes(shape_list) -> float:
    return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(dims) for dt, dims in shape_list)


class Module:
    """A parsed HLO module: instructions per computation and each computation's run count.

    A `conditional` runs one of its branches: each is counted as running every time, unless
    `branch_share` gives, for conditionals with that many branches, the fraction of the runs each
    branch takes (the pipeline engine's switch per tick: `train.pipeline.Program.branch_share`,
    averaged over the devices, which run different branches at the same tick)."""

    def __init__(self, text: str, branch_share: list[float] | None = None):
        self.instrs: list[Instr] = []
        self.defs: dict = {}    # (computation, name) -> Instr, and name -> first Instr so named
        self.entry = None
        edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
        comp = None
        for line in text.splitlines():
            m = _COMP.match(line)
            if m and "=" not in line.split("(")[0]:
                comp = m.group(2)
                if m.group(1):
                    self.entry = comp
                continue
            im = _INSTR.match(line)
            if not im or comp is None:
                continue
            ins = Instr(im.group(1), im.group(2), im.group(3), im.group(4), comp)
            self.instrs.append(ins)
            self.defs[(comp, ins.name)] = ins
            self.defs.setdefault(ins.name, ins)
            if ins.opcode.endswith(("-done", "-update")):
                continue        # an async pair's `calls=` names the computation its start runs
            trip = _TRIP.search(ins.rest)
            for kind, callee in _CALLS.findall(ins.rest):
                n = int(trip.group(1)) if (ins.opcode == "while" and kind in ("body", "condition")
                                           and trip) else 1
                edges[comp].append((callee, n))
            for b in _BRANCHES.findall(ins.rest):
                names = [c.strip().lstrip("%") for c in b.split(",") if c.strip()]
                share = branch_share if branch_share and len(branch_share) == len(names) \
                    else [1] * len(names)
                edges[comp] += list(zip(names, share))
        self.unknown_trip = [i.name for i in self.instrs
                             if i.opcode == "while" and not _TRIP.search(i.rest)]
        self.runs = self._propagate(edges)

    def _propagate(self, edges) -> dict[str, float]:
        runs: dict[str, float] = defaultdict(float)
        if self.entry is None:
            return runs
        order, seen = [], set()

        def visit(c):           # post-order DFS gives a reverse topological order
            if c in seen:
                return
            seen.add(c)
            for callee, _ in edges.get(c, ()):
                visit(callee)
            order.append(c)
        visit(self.entry)
        runs[self.entry] = 1.0
        for c in reversed(order):
            for callee, n in edges.get(c, ()):
                runs[callee] += runs[c] * n
        return runs

    def operand_shapes(self, ins: Instr) -> list[list | None]:
        """Each operand's shapes: printed inline (`f32[8,64]{1,0} %a`), else those of the
        instruction that defines the name (optimized HLO prints operands by name only)."""
        out = []
        for op in _split_top(_operand_text(ins.rest)):
            op = re.sub(r"/\*.*?\*/", "", op).strip()
            if "[" in op:
                out.append(shapes(op))
                continue
            d = self.defs.get((ins.computation, op.lstrip("%"))) or self.defs.get(op.lstrip("%"))
            out.append(shapes(d.type_str) if d else None)
        return out


def _operand_text(rest: str) -> str:
    """The operand list of an instruction: `rest` up to the parenthesis closing `opcode(`."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += (ch in "([{") - (ch in ")]}")
        if depth == 0:
            return rest[:i]
    return rest


def _split_top(s: str) -> list[str]:
    """`s` split at the commas outside any bracket, blank pieces dropped."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


def _tuple_elements(type_str: str) -> list[str]:
    """Top-level elements of a tuple type `(a, (b, c), d)`; a non-tuple type is its own element."""
    t = type_str.strip()
    return _split_top(t[1:-1]) if t.startswith("(") and t.endswith(")") else [t]


# ----------------------------------------------------------------------------- device groups
def _iota(dims, perm, out_shape):
    arr = np.arange(math.prod(dims)).reshape(dims)
    if perm:
        arr = arr.transpose(perm)
    return arr.reshape(out_shape)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def replica_groups(rest: str) -> list[list[int]] | None:
    """Device groups of a collective, or None if it names none (all devices in one group)."""
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:\s*,\s*\{[\d,\s]*\})*)?\}", rest)
    if m:
        return [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1) or "")] or None
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        perm = _ints(m.group(4)) if m.group(4) else None
        return _iota(_ints(m.group(3)), perm, (g, s)).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=(\([^)]*\)\)?|\{[^}]*\}))?"
                  r"\s*\{([^}]*)\}", rest)
    if m:
        axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        dev = m.group(2)
        if dev and dev.startswith("("):
            dm = re.match(r"\(\[([\d,]+)\](?:T\(([\d,]+)\))?", dev)
            ids = _iota(_ints(dm.group(1)), _ints(dm.group(2)) if dm.group(2) else None, sizes)
        elif dev:
            ids = np.array(_ints(dev.strip("{}"))).reshape(sizes)
        else:
            ids = np.arange(math.prod(sizes)).reshape(sizes)
        group_axes = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        if not group_axes:
            return [[int(i)] for i in ids.flat]
        keep = [i for i in range(len(names)) if i not in group_axes]
        size = math.prod(sizes[i] for i in group_axes)
        return ids.transpose(keep + group_axes).reshape(-1, size).tolist()
    return None


def source_target_pairs(rest: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if not m:
        return []
    return [tuple(_ints(p)) for p in re.findall(r"\{([\d,\s]+)", m.group(1) + "}")]


def collective_kind(opcode: str) -> str | None:
    base = opcode[:-6] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVES else None


def result_bytes(ins: Instr, kind: str) -> float:
    """Per-device result bytes of a collective, reading through async `-start` tuples."""
    if ins.opcode.endswith("-start"):
        elems = _tuple_elements(ins.type_str)
        if len(elems) > 1 and elems[0].startswith("("):
            # ((operands...), output(s), [context]): the generic async wrapper in its sugared
            # spelling (`reduce-scatter-start`, `all-to-all-start`, ...) and combined all-gathers
            return nbytes(s for s in shapes(elems[1]) if s[1] or elems[1].count("[") == 1)
    sh = [s for s in shapes(ins.type_str) if s[1] or ins.type_str.count("[") == 1]
    if ins.opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
        arrays = [s for s in sh if s[1]]       # (inputs..., outputs..., [context scalars])
        sh = arrays[len(arrays) // 2:]
    return nbytes(sh)


# ----------------------------------------------------------------------------- matmul FLOPs
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
