"""python experiments/04_activation_checkpointing.py [--out runs/exp04]

Topic 04: activation checkpointing (`plan.remat`), tiny model with 3 layers, one device, batch 2
x 128 tokens, fp32. For each policy (none, save_dots, save_attention_out, full):

- the compiled train step's temp bytes and its matmul FLOPs (`inspect.flops`: loop-aware HLO dot
  FLOPs), as ratios to `none`;
- the activations saved per layer for the backward: the outputs of the compiled forward half of
  `jax.vjp` (its residuals) that are stacked over the layer scan, less the layer's own weights.

Recompute FLOPs. Backward matmuls cost twice the forward, so a step is 3F (F = forward dot FLOPs
of blocks + LM head) plus what the policy recomputes, R: ratio = (3F + R) / 3F. `full` recomputes
each block's forward except its last matmul (w_down's output is not needed by the backward) and
never the head, so its ratio is below the textbook 4/3; `save_attention_out` also skips P @ V;
`save_dots` recomputes only the two attention matmuls (they have batch dimensions, not saveable).

Activations per layer (derived for this block: RMSNorm, GQA attention with an fp32 softmax,
SwiGLU, no dropout; b batch, s sequence, h model dim, a heads, k kv heads, d head dim, f MLP dim,
beta bytes per activation element). `none` keeps, per norm, its input and scaled output (2bsh
each, 4 in all: the norm's backward recomputes the normalised input, `models.layers.rms_norm`); q
after RoPE and the attention output (2·bs·a·d); k after RoPE and v (2·bs·k·d); gate, up,
sigmoid(gate), 1-sigmoid, silu(gate) and the hidden product (6bsf); four fp32 score-sized arrays
(scores, exp, masked, normalised: 16·b·a·s² bytes); per score row the max, sum and masked max in
fp32 and two boolean masks (14·b·a·s bytes); one fp32 1/rms [b, s] per norm (8·bs bytes). In
Korthikanti's units (bytes per layer = sbh·(c + c'·as/h)) that is sbh·(beta·(4 + (2a+2k)d/h + 6f/h)
+ 16·as/h) + small terms, against GPT's sbh·(34 + 5as/h). `full` keeps the layer input (beta·bsh);
`save_attention_out` the input and attention output; `save_dots` the input, q, k, v, the output
projection and gate, up. Writes remat.png.
"""
from __future__ import annotations

import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale import models  # noqa: E402
from jaxscale.analysis import inspect  # noqa: E402
from jaxscale.axes import use_rules  # noqa: E402
from jaxscale.strategies import remat  # noqa: E402
from jaxscale.train.grads import token_loss  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

POLICIES = ("none", "save_dots", "save_attention_out", "full")
L, B, S = 3, 2, 128          # L != B: stacked residuals are told apart by their leading dim


def dot_flops(m, s: int) -> dict:
    """Forward matmul FLOPs per token, per layer (and the head)."""
    h, a, k, d, f = m.dim, m.n_heads, m.n_kv_heads, m.hd, m.ffn_dim
    return {"qkv": 2 * h * d * (a + 2 * k), "wo": 2 * a * d * h, "qk": 2 * s * d * a,
            "pv": 2 * s * d * a, "gate_up": 4 * h * f, "down": 2 * f * h,
            "head": 2 * h * m.vocab_size}


def expected_ratio(policy: str, m, s: int) -> float:
    fl = dot_flops(m, s)
    block = sum(v for n, v in fl.items() if n != "head")
    F = m.n_layers * block + fl["head"]
    R = {"none": 0, "save_dots": fl["qk"] + fl["pv"],
         "save_attention_out": block - fl["pv"] - fl["down"], "full": block - fl["down"]}[policy]
    return (3 * F + m.n_layers * R) / (3 * F)


def act_bytes(policy: str, m, b: int, s: int, beta: int = 4) -> float:
    """Saved activations per layer for the backward (module docstring)."""
    h, a, k, d, f = m.dim, m.n_heads, m.n_kv_heads, m.hd, m.ffn_dim
    return beta * b * s * {
        "none": 4 * h + 2 * a * d + 2 * k * d + 6 * f,
        "full": h, "save_attention_out": h + a * d,
        "save_dots": 2 * h + (a + 2 * k) * d + 2 * f}[policy] + (
        16 * b * a * s * s + 14 * b * a * s + 8 * b * s if policy == "none" else 0)


def measure(policy: str) -> dict:
    cfg = C.config(*C.ONE, f"plan.remat={policy}", n_layers=L, seq=S, batch=B)
    setup = build(cfg, jax.devices()[:1])
    step = setup.lower_train_step().compile()
    wrap = remat.block_wrapper(policy)

    def forward(params, batch):           # the forward half of the gradient: its residuals
        def loss(p):
            total, n = token_loss(setup.model.apply(p, batch["inputs"], block_wrapper=wrap),
                                  batch["targets"], batch["mask"])
            return total / n
        with use_rules(setup.placement.mesh, setup.placement.rules):
            return jax.vjp(loss, params)[1]
    params = setup.abstract_state().params
    with jax.set_mesh(setup.placement.mesh):
        fwd = jax.jit(forward).lower(params, setup.abstract_batch()).compile()
    outs = jax.tree.leaves(fwd.out_info)
    nbytes = lambda x: int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    squeeze = lambda shape: tuple(d for d in shape if d != 1)
    weights = {squeeze(x.shape) for x in jax.tree.leaves(params)}   # weights (and reshapes)
    stacked = sum(nbytes(x) for x in outs if x.shape and x.shape[0] == L
                  and squeeze(x.shape) not in weights)
    slack = inspect.memory(fwd)["output"] - sum(nbytes(x) for x in outs)
    assert 0 <= slack <= 8 * len(outs), slack     # the output tuple's pointer table
    return {"temp": inspect.memory(step)["temp"], "flops": inspect.flops(step)["dot_flops"],
            "act_per_layer": stacked / L, "model": cfg.model}


def main():
    args = C.parse_args(__doc__, "runs/exp04")
    t0 = time.time()
    claims = C.Claims()
    res = {p: measure(p) for p in POLICIES}
    m = res["none"]["model"]
    rows = []
    for p in POLICIES:
        r, ratio, exp = res[p], res[p]["flops"] / res["none"]["flops"], expected_ratio(p, m, S)
        derived = act_bytes(p, m, B, S)
        rows.append([p, f"{r['temp'] / C.MiB:.2f}", f"{r['temp'] / res['none']['temp']:.3f}",
                     f"{r['flops'] / 1e9:.4f}", f"{ratio:.4f}", f"{exp:.4f}",
                     f"{r['act_per_layer'] / C.MiB:.3f}", f"{derived / C.MiB:.3f}"])
        claims.close(f"{p}: dot FLOPs / none vs (3F + R) / 3F", ratio, exp, 0.005)
        claims.close(f"{p}: saved activations per layer vs derived formula",
                     r["act_per_layer"], derived, 0.02)
    print(C.table(["policy", "temp MiB", "temp / none", "dot GFLOP", "FLOPs / none",
                   "expected", "act/layer MiB", "derived MiB"], rows,
                  title=f"remat policies: tiny, {L} layers, batch {B} x {S}, fp32, one device"))
    t = [res[p]["temp"] for p in ("none", "save_dots", "full")]
    claims.check("temp order none > save_dots > full (MiB)",
                 " > ".join(f"{x / C.MiB:.1f}" for x in t), "decreasing", t[0] > t[1] > t[2])
    full = res["full"]["flops"] / res["none"]["flops"]
    claims.check("full remat recomputes less than the textbook 4/3", full, "< 1.3333",
                 1.2 < full < 4 / 3)

    print("\nwhy full remat is not 4/3: ratio = (3F + L (block - w_down)) / 3F, head never "
          "recomputed")
    big = []
    for name, s in (("tiny", S), ("small", 2048), ("llama3-8b", 4096), ("llama3-70b", 8192)):
        mm = models.get(name) if name != "tiny" else m
        fl = dot_flops(mm, s)
        block = sum(v for n, v in fl.items() if n != "head")
        big.append([name, s, f"{fl['down'] / block:.3f}",
                    f"{fl['head'] / (mm.n_layers * block):.4f}",
                    f"{expected_ratio('full', mm, s):.4f}"])
    print(C.table(["model", "seq", "w_down / block", "head / blocks", "full remat ratio"], big))
    c = lambda mm, beta: beta * (4 + (2 * mm.n_heads + 2 * mm.n_kv_heads) * mm.hd / mm.dim
                                 + 6 * mm.ffn_dim / mm.dim)
    kor = [[n, f"{c(mm, 4):.0f}", f"{c(mm, 2):.0f}", "16", "34", "5"]
           for n, mm in (("tiny", m), ("llama3-8b", models.get("llama3-8b")))]
    print()
    print(C.table(["model", "c (fp32, the formula checked above)", "c (16-bit activations)",
                   "c' (fp32 softmax)", "GPT c", "GPT c'"], kor,
                  title="per-layer activations with no remat: sbh (c + c' as/h) bytes, this "
                        "block vs Korthikanti's GPT block (16-bit, dropout)"))

    plt = C.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(POLICIES))
    a1.bar(x - 0.2, [res[p]["act_per_layer"] / C.MiB for p in POLICIES], 0.4, label="measured")
    a1.bar(x + 0.2, [act_bytes(p, m, B, S) / C.MiB for p in POLICIES], 0.4, label="derived")
    a1.set_yscale("log")
    a1.set_xticks(x, POLICIES, fontsize=8)
    a1.set_ylabel("saved activations per layer, MiB")
    a1.set_title(f"activations kept for the backward (b={B}, s={S})")
    a1.legend()
    for p in POLICIES:
        a2.plot(res[p]["temp"] / C.MiB, res[p]["flops"] / res["none"]["flops"], "o", ms=9,
                label=p)
    a2.axhline(4 / 3, color="k", ls=":", label="4/3")
    a2.set_xlabel("compiled temp MiB (train step)")
    a2.set_ylabel("matmul FLOPs / no remat")
    a2.set_title("memory vs recompute")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    C.save(fig, args.out, "remat.png")
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {p: {k: v for k, v in r.items() if k != "model"}
                             for p, r in res.items()})


if __name__ == "__main__":
    main()
