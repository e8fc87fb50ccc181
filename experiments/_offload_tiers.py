"""Experiment 05's four offload tiers side by side (imported by `05_offload.py`; each tier is
measured in a process of its own, `python experiments/_offload_tiers.py TIER JSON`, so that its
peak resident set is its own).

Tiers, tiny LLaMA (8 layers), bf16 with fp32 master and AdamW, dp=8, batch 16 x 64:
  device          no offload
  host-streamed   plan.offload=optimizer+master (pinned_host; the update streamed per layer)
  host update     ... + plan.offload_update=host (ZeRO-Offload: numpy AdamW, one logical copy)
  nvme            ... + plan.offload_tier=nvme (files under a temporary plan.offload_dir)
Per tier: the compiled step's device-resident state (input shardings by memory kind) and device
peak (argument + output + temp - alias, without the pinned_host bytes XLA:CPU counts as
arguments), the process's peak RSS over two steady steps (VmHWM, reset after a warm-up step),
the bytes moved per step over the host link and to disk (counted by the host-driven step; for
the host-streamed tier, its pinned_host inputs and outputs), the step time, and the planner's
prediction of each beside it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

TIERS = {
    "device": ("plan.offload=none",),
    "host-streamed": ("plan.offload=optimizer+master",),
    "host update": ("plan.offload=optimizer+master", "plan.offload_update=host"),
    "nvme": ("plan.offload=optimizer+master", "plan.offload_tier=nvme"),
}
SEQ, BATCH, LAYERS, STEPS = 64, 16, 8, 2
MiB = 2 ** 20


def config(tier: str, offload_dir: str = ""):
    import _common as C
    ov = TIERS[tier] + ((f"plan.offload_dir={offload_dir}",) if tier == "nvme" else ())
    return C.config(*C.DP8, "plan.precision=bf16", *ov, seq=SEQ, batch=BATCH, n_layers=LAYERS)


def by_kind(shardings, abstract) -> dict[str, float]:
    import jax
    import numpy as np
    out = {"device": 0.0, "pinned_host": 0.0}
    for sh, leaf in zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract)):
        if leaf is None:
            continue
        out[sh.memory_kind or "device"] += float(np.prod(sh.shard_shape(leaf.shape))) * \
            np.dtype(leaf.dtype).itemsize
    return out


def measure(tier: str) -> dict:
    """One tier, in this process: see the module's docstring."""
    import dataclasses

    import _common as C  # noqa: F401  (the 8 simulated devices, before jax)

    import jax

    from jaxscale import planner
    from jaxscale.analysis import inspect
    from jaxscale.analysis.profiling import host_status, reset_host_peak
    from jaxscale.data import Batches, load_corpus
    from jaxscale.plan import Spec
    from jaxscale.strategies.offload import tiers
    from jaxscale.train.setup import build
    with tempfile.TemporaryDirectory(prefix="exp05-nvme-") as d:
        cfg = config(tier, d)
        spec, pred = Spec.from_config(cfg), planner.predict(cfg)
        setup = build(cfg)
        driver = getattr(setup.train_step, "host_driven", False) and setup.train_step
        # the host-driven step's device program is compiled by its first call; the jitted step
        # is compiled here and run as compiled (one compile per program)
        exe = None if driver else setup.lower_train_step().compile()
        step = driver or exe
        batches = Batches(load_corpus(cfg.data).train, BATCH, SEQ, seed=0)
        state, losses, counted, times = setup.init_state(), [], [], []
        for i in range(1 + STEPS):
            if i == 1:
                peak_ok = reset_host_peak()
                rss_before = host_status("VmRSS")       # resident between steps
            if driver:
                driver.reset_counts()
            b = {k: jax.device_put(v, setup.batch_shardings()[k])
                 for k, v in batches.global_rows(i).items()}
            t0 = time.perf_counter()
            state, m = step(state, b)
            losses.append(float(m["loss"]))
            times.append(time.perf_counter() - t0)
            if driver:
                counted.append(driver.counted())
        peak = host_status("VmHWM")
        abstract = setup.abstract_state()
        if driver:
            exe = driver.lower(state, b).compile()
            abstract = dataclasses.replace(abstract, opt_state=None, master=None)
        ins = by_kind(exe.input_shardings[0][0], abstract)
        outs = by_kind(exe.output_shardings[0], abstract)
        mem = inspect.memory(exe)
        n = spec.n_devices
        if driver:
            link = {"in": counted[-1]["link_in"], "out": counted[-1]["link_out"]}
            disk = {"read": counted[-1]["disk_read"], "written": counted[-1]["disk_written"]}
            steady = all(c == counted[-1] for c in counted[1:])
        else:       # the streamed loop moves each device's pinned_host state in and back out
            link = {"in": ins["pinned_host"] * n, "out": outs["pinned_host"] * n}
            disk, steady = {"read": 0, "written": 0}, True
        return {
            "tier": tier, "psi": tiers.psi(spec), "losses": losses,
            "state_device": ins["device"], "state_host": ins["pinned_host"],
            "device_peak": mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
            - ins["pinned_host"] - outs["pinned_host"],
            "memory": mem, "rss_peak": peak, "rss_before": rss_before,
            "rss_reset": peak_ok,
            "link": link, "disk": disk, "counts_steady": steady,
            "step_s": min(times[1:]),
            "formula": {"link": tiers.host_link_bytes(spec), "disk": tiers.disk_bytes(spec),
                        "store": tiers.store_bytes(spec)},
            "predicted": {"device": pred.memory.total, "host": pred.memory.host,
                          "disk": getattr(pred.memory, "disk", {}),
                          "state": pred.memory.params + pred.memory.master
                          + pred.memory.optimizer,
                          "offload_s": pred.time.offload, "step_s": pred.time.total,
                          "seconds": tiers.seconds(spec, pred.time.compute)},
        }


def run_all() -> dict[str, dict]:
    """Every tier, each in a fresh process (its own peak RSS), sharing one compilation cache
    (a program compiled for `memory_analysis` is not compiled again for the call)."""
    res = {}
    cache = tempfile.TemporaryDirectory(prefix="exp05-jax-cache-")
    for tier in TIERS:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            here = os.path.dirname(os.path.abspath(__file__))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                filter(None, [os.path.dirname(here), os.environ.get("PYTHONPATH")])),
                JAX_COMPILATION_CACHE_DIR=cache.name,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
            subprocess.run([sys.executable, os.path.abspath(__file__), tier, f.name],
                           check=True, env=env)
            res[tier] = json.load(open(f.name))
    cache.cleanup()
    return res


def report(res: dict[str, dict], claims, out: str) -> None:
    """The tiers' table, their claims and `offload_tiers.png`."""
    import _common as C

    import numpy as np
    base, n = res["device"], 8
    psi = base["psi"]
    rows = []
    for t, r in res.items():
        p = r["predicted"]
        rows.append([t, f"{r['state_device'] / MiB:.2f}", f"{r['device_peak'] / MiB:.2f}",
                     f"{p['device'] / MiB:.2f}", f"{r['rss_before'] / MiB:.0f}",
                     f"{(base['rss_before'] - r['rss_before']) / MiB:+.0f}",
                     f"{r['rss_peak'] / MiB:.0f}",
                     f"{sum(p['host'].values()) * n / MiB:.2f}",
                     f"{sum(p['disk'].values()) * n / MiB:.2f}",
                     f"{r['link']['in'] / MiB:.2f} / {r['link']['out'] / MiB:.2f}",
                     f"{r['disk']['read'] / MiB:.2f} / {r['disk']['written'] / MiB:.2f}",
                     f"{r['step_s'] * 1e3:.0f}", f"{p['offload_s'] * 1e3:.2f}"])
    print(C.table(["tier", "device state MiB", "device peak MiB", "planner", "RSS MiB",
                   "saved", "peak RSS MiB", "planner host MiB", "planner disk MiB",
                   "link in / out MiB", "disk read / written MiB", "step ms (CPU)",
                   "planner offload ms"], rows,
                  title=f"offload tiers, tiny LLaMA {LAYERS} layers (Psi = {psi:,}), bf16 + fp32 "
                        f"master + AdamW, dp=8, batch {BATCH} x {SEQ}: device state and peak per "
                        f"device (compiled); the process's RSS between steps (freed heap trimmed), "
                        f"what it saves against the device tier, its peak over {STEPS} steps; "
                        f"bytes per step for all 8 devices; planner host/disk for the process"))
    for t, r in res.items():
        if t != "device":
            diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
            claims.check(f"tier {t}: {len(r['losses'])} steps' losses match the device tier",
                         diff, "< 1e-5", diff < 1e-5)
            drop = base["state_device"] - r["state_device"]
            want = r["formula"]["store"] if t in ("host update", "nvme") else 12 * psi
            claims.check(f"tier {t}: device-resident state falls by the offloaded bytes "
                         f"(12 Psi{' + counters' if want != 12 * psi else ''})",
                         f"{drop:,.0f}", f"{want:,}", drop == want)
            claims.check(f"tier {t}: device peak below the device tier's (MiB)",
                         f"{r['device_peak'] / MiB:.2f}", f"< {base['device_peak'] / MiB:.2f}",
                         r["device_peak"] < base["device_peak"])
        f = r["formula"]
        claims.check(f"tier {t}: host link bytes per step in / out = tiers.host_link_bytes",
                     f"{r['link']['in']:,.0f} / {r['link']['out']:,.0f}",
                     f"{f['link']['in']:,.0f} / {f['link']['out']:,.0f}",
                     r["link"] == f["link"] and r["counts_steady"])
        claims.check(f"tier {t}: disk bytes per step read / written = tiers.disk_bytes",
                     f"{r['disk']['read']:,} / {r['disk']['written']:,}",
                     f"{f['disk']['read']:,} / {f['disk']['written']:,}", r["disk"] == f["disk"])
    # host RAM: on XLA:CPU device memory is host RAM, so the 8 device (or pinned_host) copies of
    # the offloaded state count in the RSS; between steps the host update keeps one copy of it
    # (its store), nvme none (the pieces live only during the update)
    copies = 12 * psi * n
    for t, kept in (("host-streamed", copies), ("host update", res["nvme"]["formula"]["store"]),
                    ("nvme", 0)):
        saved, want = base["rss_before"] - res[t]["rss_before"], copies - kept
        claims.check(f"{t}: RSS between steps saved vs the device tier = the 8 device copies "
                     f"of the offloaded state less what it keeps in RAM (MiB, within 25% of "
                     f"the copies)", f"{saved / MiB:.1f}", f"{want / MiB:.1f}",
                     abs(saved - want) <= 0.25 * copies)
    claims.check("planner: nvme's offloaded state on disk, host RAM only the pieces in flight",
                 f"disk {sum(res['nvme']['predicted']['disk'].values()) * n:,.0f}, pieces "
                 f"{res['nvme']['predicted']['host'].get('pieces', 0) * n:,.0f}",
                 f"disk {res['nvme']['formula']['store']:,}, pieces < disk",
                 abs(sum(res["nvme"]["predicted"]["disk"].values()) * n
                     - res["nvme"]["formula"]["store"]) < 1
                 and set(res["nvme"]["predicted"]["host"]) == {"pieces"})

    plt = C.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(res)
    x = np.arange(len(names))
    bars = {"device peak x 8 devices (compiled)": [res[t]["device_peak"] * n for t in names],
            "RSS between steps": [res[t]["rss_before"] for t in names],
            "peak RSS over the steps": [res[t]["rss_peak"] for t in names],
            "on disk (store)": [res[t]["disk"]["read"] for t in names]}
    for k, (label, v) in enumerate(bars.items()):
        a1.bar(x + (k - 1.5) * 0.2, np.array(v) / MiB, 0.2, label=label)
    a1.set_xticks(x, names)
    a1.set_ylabel("MiB")
    a1.set_title("memory per tier (XLA:CPU: device memory is host RAM)", fontsize=9)
    a1.legend(fontsize=7)
    kinds = (("link", "in"), ("link", "out"), ("disk", "read"), ("disk", "written"))
    for k, (what, way) in enumerate(kinds):
        xs = x + (k - 1.5) * 0.2
        a2.bar(xs, [res[t][what][way] / MiB for t in names], 0.2, label=f"{what} {way}")
        a2.plot(xs, [res[t]["formula"][what][way] / MiB for t in names], "kx", ms=5)
    a2.plot([], [], "kx", label="tiers.py formula")
    a2.set_xticks(x, names)
    a2.set_ylabel("MiB per step (8 devices)")
    a2.set_title("bytes moved per step: counted (bars) vs formula (x)", fontsize=9)
    a2.legend(fontsize=7)
    C.save(fig, out, "offload_tiers.png")


if __name__ == "__main__":      # one tier in a process of its own (its directory is on the path)
    with open(sys.argv[2], "w") as out:
        json.dump(measure(sys.argv[1]), out, default=float)
