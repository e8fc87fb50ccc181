"""python experiments/05_offload.py [--out runs/exp05]

Topic 05: host offload (`plan.offload`, `plan.remat=offload`), tiny model (2 layers), bf16 with
fp32 master and Adam, dp=8, batch 16 x 64.

1. State placement: for offload none / optimizer / optimizer+master / params, the per-device
   bytes of the compiled step's inputs in device and in host (`pinned_host`) memory, read from the
   compiled executable's input shardings. Device-resident bytes should drop by exactly the
   offloaded state: Adam moments 8 bytes/param, + fp32 master 4, or the bf16 params 2. Three
   training steps of each give the same losses.
2. The streamed update: the optimizer update runs as a loop over the layers that brings one
   layer of the offloaded state to the device, updates it and writes it back into host memory
   (`jaxscale.strategies.offload.streaming.streamed_update`). Read from the program lowered for CUDA
   (here, without a GPU: XLA:CPU lowers memory-space moves to nothing), every host->device move of
   offloaded state is one layer's slice in the loop or an unstacked leaf, never a whole stacked
   leaf; from the CPU-compiled program, the temp against no offload (whose update runs in place on
   the device-resident state: the streamed one may hold one piece, a layer of the offloaded state,
   more) and against the planner's prediction (`jaxscale.planner`, tolerance as in
   planner_validation).
3. Activation offload: the bytes `plan.remat=offload` sends to host memory per step (device_puts
   the checkpoint policy inserts, times the layer scan), against q, k, v, attention output, output
   projection, gate and up per layer (the policy names mlp_down too, but no backward computation
   needs a layer's last matmul output, so it is neither kept nor sent).
4. A PCIe-bound step-time model: every offloaded byte crosses the host link twice per step (in
   for the step, back after the update; offloaded activations out in the forward and back in the
   backward). Transfer time = bytes / `host_bw` of `jaxscale/hardware.py`, against compute time =
   dot FLOPs / (peak x matmul efficiency), for this run and for Llama-3-8B under FSDP over N = 8
   H100s. A device moves 2 x b x Psi / N bytes (b offloaded bytes/param) and computes ~6 Psi
   FLOPs per token, so the copies hide behind compute from T* = b x peak x eff / (3 N host_bw)
   tokens per device per step on, whatever the model size.
5. The four tiers side by side (`_offload_tiers.py`, one process each, tiny LLaMA with 8 layers):
   device (no offload), host-streamed (`plan.offload=optimizer+master`), host update
   (`plan.offload_update=host`, ZeRO-Offload) and NVMe (`plan.offload_tier=nvme`, a temporary
   `plan.offload_dir`): device-resident state and device peak (compiled), the process's peak RSS,
   the bytes moved per step over the host link and to disk as counted against `offload/tiers.py`'s
   formulas, the step time, and the planner's prediction of each.
(XLA:CPU keeps both memory kinds in the same RAM and emits no copies, so the CPU measures where
state lives and how many bytes move, not how long they take.) Writes offload.png and
offload_tiers.png (memory per tier, bytes per step per tier).
"""
from __future__ import annotations

import re  # noqa: E402
import time
from collections import Counter  # noqa: E402

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

import _offload_tiers as tiers_lib  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale import (  # noqa: E402
    hardware,
    models,  # noqa: E402
    planner,
)
from jaxscale.analysis import (
    inspect,
    validation,  # noqa: E402
)
from jaxscale.data import Batches, load_corpus  # noqa: E402
from jaxscale.plan import Spec  # noqa: E402
from jaxscale.strategies import offload as offload_lib  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

OFFLOADS = ("none", "optimizer", "optimizer+master", "params")
BYTES_PER_PARAM = {"optimizer": 8, "master": 4, "params": 2}
SEQ, BATCH = 64, 16


def by_kind(shardings, abstract) -> dict[str, float]:
    out = {"device": 0.0, "pinned_host": 0.0}
    for sh, leaf in zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract)):
        n = float(np.prod(sh.shard_shape(leaf.shape))) * np.dtype(leaf.dtype).itemsize
        out[sh.memory_kind or "device"] += n
    return out


def placement(offload: str, batches) -> dict:
    cfg = C.config(*C.DP8, "plan.precision=bf16", f"plan.offload={offload}", seq=SEQ,
                   batch=BATCH)
    setup = build(cfg)
    args = (setup.abstract_state(), setup.abstract_batch())
    exe = setup.lower_train_step().compile()
    pred = planner.predict(cfg).memory
    inputs = by_kind(exe.input_shardings[0], args)
    outputs = by_kind(exe.output_shardings[0], args[0])
    state, losses = setup.init_state(), []
    for i in range(3):
        b = {k: jax.device_put(v, setup.batch_shardings()[k])
             for k, v in batches.global_rows(i).items()}
        state, m = exe(state, b)
        losses.append(float(m["loss"]))
    return {"offload": offload, "device": inputs["device"], "host": inputs["pinned_host"],
            "host_out": outputs["pinned_host"], "flops": inspect.flops(exe)["dot_flops"],
            "losses": losses, "psi": cfg.model.param_count(),
            "temp": inspect.memory(exe)["temp"],
            "temp_predicted": pred.xla["temp"],
            "piece": offload_lib.piece_bytes(Spec.from_config(cfg)) if offload != "none" else 0.0,
            "moves": gpu_moves(setup) if offload != "none" else {}}


def gpu_moves(setup) -> dict:
    """Memory-space moves (`annotate_device_placement`) of the program lowered for CUDA: how many
    go to the device and to host memory inside the layer loop, and how many bring a whole
    host-resident layer-stacked leaf to the device anywhere (shapes that a device-resident leaf
    also has are not counted: the step's outputs are annotated with their memory kind too)."""
    with jax.set_mesh(setup.placement.mesh):
        text = setup.train_step.trace(setup.abstract_state(), setup.abstract_batch()).lower(
            lowering_platforms=("cuda",)).as_text(dialect="hlo")
    comp, calls, bodies, moves = None, {}, set(), []
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?([\w.\-]+)\s.*\{\s*$", line)
        if m and "=" not in line.split("(")[0]:
            comp = m.group(1)
        calls.setdefault(comp, set()).update(
            re.findall(r"\b(?:calls|to_apply|body)=%?([\w.\-]+)", line))
        bodies.update(re.findall(r"\bbody=%?([\w.\-]+)", line))
        kind = re.search(r'= (\w+\[[\d,]*\]).*annotate_device_placement.*'
                         r'_xla_buffer_placement="(\w+)"', line)
        if kind:
            moves.append((comp, kind.group(2), kind.group(1)))
    loop, todo = set(), list(bodies)
    while todo:
        c = todo.pop()
        if c not in loop:
            loop.add(c)
            todo += calls.get(c, ())

    def hlo_shape(x):
        return f"{np.dtype(x.dtype).name.replace('float', 'f')}[{','.join(map(str, x.shape))}]"
    leaves = jax.tree.leaves(setup.abstract_state())
    L = setup.cfg.model.n_layers
    host = {hlo_shape(x) for x in leaves if x.sharding.memory_kind == "pinned_host"
            and x.ndim and x.shape[0] == L}
    host -= {hlo_shape(x) for x in leaves if x.sharding.memory_kind != "pinned_host"}
    count = Counter((c in loop, k) for c, k, _ in moves)
    return {"in_loop_to_device": count[(True, "device")],
            "in_loop_to_host": count[(True, "pinned_host")],
            "whole_stacked_to_device": sum(k == "device" and sh in host for _, k, sh in moves),
            "checked_shapes": len(host)}


def main():
    args = C.parse_args(__doc__, "runs/exp05")
    t0 = time.time()
    claims = C.Claims()
    batches = Batches(load_corpus(C.config().data).train, BATCH, SEQ, seed=0)
    res = {o: placement(o, batches) for o in OFFLOADS}
    base, psi = res["none"], res["none"]["psi"]
    rows = []
    for o, r in res.items():
        expected = sum(BYTES_PER_PARAM[p] for p in o.split("+") if p != "none") * psi
        drop = base["device"] - r["device"]
        rows.append([o, f"{r['device'] / C.MiB:.3f}", f"{r['host'] / C.MiB:.3f}",
                     f"{drop:,.0f}", f"{expected:,}", f"{r['host_out']:,.0f}",
                     " ".join(f"{x:.5f}" for x in r["losses"])])
        if o != "none":
            claims.check(f"{o}: device drop = host bytes = offloaded state (bytes)",
                         f"{drop:,.0f} / {r['host']:,.0f}", f"{expected:,}",
                         drop == r["host"] and abs(drop - expected) <= 64)
            diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
            claims.check(f"{o}: 3 training steps match no offload (max |loss diff|)", diff,
                         "< 1e-6", diff < 1e-6)
    print(C.table(["offload", "device MiB", "host MiB", "device drop (B)",
                   "expected (B/param x Psi)", "host bytes written back", "losses"], rows,
                  title=f"per-device train state, bf16 + fp32 master + Adam, dp=8 (Psi = "
                        f"{psi:,}; step counters stay on device)"))

    stream_rows = []
    for o, r in res.items():
        mv = r["moves"]
        ratio = r["temp_predicted"] / r["temp"]
        stream_rows.append([o, f"{r['temp'] / C.MiB:.3f}", f"{r['temp_predicted'] / C.MiB:.3f}",
                            f"{ratio:.3f}", mv.get("in_loop_to_device", "-"),
                            mv.get("in_loop_to_host", "-"),
                            mv.get("whole_stacked_to_device", "-")])
        tol = validation.TOLERANCE["temp"]
        claims.check(f"{o}: planner temp / compiled temp", f"{ratio:.3f}", f"within {tol:.0%}",
                     abs(ratio - 1) <= tol)
        if o == "none":
            continue
        claims.check(f"{o}: compiled temp not above no offload's + one streamed piece (MiB)",
                     f"{r['temp'] / C.MiB:.3f}",
                     f"<= {base['temp'] / C.MiB:.3f} + {r['piece'] / C.MiB:.3f}",
                     r["temp"] <= base["temp"] + r["piece"])
        # back to host: a layer of each offloaded stacked leaf; to the device the same, but for
        # the working parameters, which the update never reads (it casts the new master)
        back = 9 * sum(2 if p == "optimizer" else 1 for p in o.split("+"))
        fetched = back - 9 * ("params" in o.split("+"))
        claims.check(f"{o}: layer slices moved in the loop, to device / to host",
                     f"{mv['in_loop_to_device']} / {mv['in_loop_to_host']}",
                     f"{fetched} / {back}",
                     mv["in_loop_to_device"] == fetched and mv["in_loop_to_host"] == back)
        # the working parameters come over whole for the forward; with the master weights on
        # the device, the moments' shapes are the master's too (no shape left to tell them by)
        if o != "params" and mv["checked_shapes"]:
            claims.check(f"{o}: whole stacked offloaded leaves moved to the device",
                         mv["whole_stacked_to_device"], f"0 (of {mv['checked_shapes']} shapes)",
                         mv["whole_stacked_to_device"] == 0)
    print()
    print(C.table(["offload", "temp MiB (CPU)", "predicted", "ratio", "moves in loop: to device",
                   "to host", "whole stacked leaves to device"], stream_rows,
                  title="the streamed update: compiled temp on XLA:CPU; memory-space moves of "
                        "the program lowered for CUDA (9 stacked leaves per part)"))

    cfg = C.config(*C.DP8, "plan.precision=bf16", "plan.remat=offload", seq=SEQ, batch=BATCH)
    setup = build(cfg)
    act = inspect.offloaded_activation_bytes(setup.train_step, setup.abstract_state(),
                                             setup.abstract_batch()) / 8
    m = cfg.model
    per_layer = BATCH // 8 * SEQ * (2 * m.n_heads * m.hd + 2 * m.n_kv_heads * m.hd
                                    + 2 * m.ffn_dim + m.dim) * 2      # bf16, no mlp_down
    claims.check("remat=offload: activation bytes to host per device per step",
                 f"{act:,.0f}", f"{m.n_layers * per_layer:,}", act == m.n_layers * per_layer)
    print(f"\nactivation offload (plan.remat=offload): {act:,.0f} bytes per device per step to "
          f"host = {m.n_layers} layers x {per_layer:,} (q, k, v, attn_out, o_proj, gate, up "
          f"in bf16; mlp_down's value is never needed by the backward, so it is not kept)")

    # ---------------------------------------------------------------- PCIe-bound step time
    h100 = hardware.get("h100")
    eff_peak = h100.peak_bf16 * h100.matmul_efficiency
    model_rows = []
    for o, r in res.items():
        moved = r["host"] + r["host_out"]
        model_rows.append(["this run (tiny)", o, f"{moved / 1e6:.2f}",
                           f"{moved / h100.host_bw * 1e6:.1f} us",
                           f"{r['flops'] / eff_peak * 1e6:.2f} us",
                           f"{moved / h100.host_bw / (r['flops'] / eff_peak):.0f}x", "-"])
    big = models.get("llama3-8b")
    n_dev, tokens = 8, 8 * 4096                                  # per device: 8 x 4096 tokens
    compute = big.flops_per_token(4096) * tokens / eff_peak
    for o in OFFLOADS:
        b_off = sum(BYTES_PER_PARAM.get(p, 0) for p in o.split("+"))
        moved = 2 * b_off * big.param_count() / n_dev
        t_star = b_off * eff_peak / (3 * n_dev * h100.host_bw)
        model_rows.append(["llama3-8b, fsdp=8", o, f"{moved / 1e6:.0f}",
                           f"{moved / h100.host_bw * 1e3:.0f} ms" if moved else "0",
                           f"{compute * 1e3:.0f} ms", f"{moved / h100.host_bw / compute:.2f}x",
                           f"{t_star:,.0f}" if b_off else "-"])
    print()
    print(C.table(["case", "offload", "MB moved / step", "PCIe time", "compute time",
                   "PCIe / compute", "T* tokens/device"], model_rows,
                  title=f"PCIe-bound step time on an H100 (host link {h100.host_bw / 1e9:.0f} "
                        f"GB/s, {eff_peak / 1e12:.0f} TFLOP/s sustained); llama3-8b: "
                        f"{tokens:,} tokens per device per step"))

    plt = C.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(OFFLOADS))
    a1.bar(x, [res[o]["device"] / C.MiB for o in OFFLOADS], label="device")
    a1.bar(x, [res[o]["host"] / C.MiB for o in OFFLOADS],
           bottom=[res[o]["device"] / C.MiB for o in OFFLOADS], label="pinned_host")
    a1.set_xticks(x, OFFLOADS, fontsize=8)
    a1.set_ylabel("train state MiB per device")
    a1.set_title("where the state lives (compiled input shardings)")
    a1.legend()
    toks = np.logspace(3, 6, 50)
    per_tok = big.flops_per_token(4096) / eff_peak
    for o in OFFLOADS[1:]:
        b_off = sum(BYTES_PER_PARAM[p] for p in o.split("+"))
        ratio = 2 * b_off * big.param_count() / n_dev / h100.host_bw / (toks * per_tok)
        a2.plot(toks, ratio, label=o)
    a2.axhline(1, color="k", ls=":")
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.set_xlabel("tokens per device per step")
    a2.set_ylabel("PCIe time / compute time")
    a2.set_title("llama3-8b, fsdp=8, H100: copies hide below 1")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3, which="both")
    C.save(fig, args.out, "offload.png")

    print()
    tier_res = tiers_lib.run_all()
    tiers_lib.report(tier_res, claims, args.out)
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {"placement": res, "activation_offload_bytes": act,
                             "tiers": tier_res})


if __name__ == "__main__":
    main()
