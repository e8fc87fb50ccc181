"""Quiet fallbacks applied to the library on a scratch copy: each one must fail a named test.

A strategy whose simple version gives the same numbers (gradients reduced per micro-batch, a
pipeline stage computing its padding, experts left whole inside the stages, a restore that
loads nothing) passes any test that compares numbers only. Each `Break` here replaces the
mechanism by that simple version, and the tests it names must fail on it: the proof that the
suite rules the fallback out. `tests/README.md` lists them.

    python -m tests.breaks            # every break: copy the tree, apply it, run its tests
    python -m tests.breaks --list     # the table, without running anything
    python -m tests.breaks --markdown # the table tests/README.md holds
    python -m tests.breaks --only host-adamw-bias --clean

`--clean` first runs the named tests on the unbroken copy (they must pass there). The copy is
the working tree's files (`git ls-files`, untracked ones included), so uncommitted changes are
tried too; the tests run in one process (`-n 0`) with the copy first on `sys.path`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Break:
    name: str
    capability: str
    fallback: str               # what the broken library does instead of the mechanism
    file: str                   # relative to the repository root
    old: str                    # the exact text replaced: it must occur once in `file`
    new: str
    tests: tuple[str, ...]      # pytest node ids; at least one must fail


T = "tests/"
OFFLOAD_TIERS = T + "test_offload_tiers.py::"
COMPRESSION = T + "test_compression.py::"
LOCAL_SGD = T + "test_local_sgd.py::"
STAGES = T + "test_pipeline_stages.py::test_stage_family_matches_one_device"
FAMILIES = T + "test_pipeline_families.py::test_family_matches_one_device_and_its_formulas"
PS = T + "test_ps.py::"
FAULTS = T + "test_faults.py::"
#: the pipeline engine's B and W passes (the zero-bubble split), and B doing both
ZB_SPLIT = """\
                    if split:
                        tape = jax.tree.map(lambda b, v: b.at[:n].set(v.astype(b.dtype)),
                                            tape, cot["taps"])
                    if first:
                        _, e_vjp = jax.vjp(lambda o: embed(o, mb), outer)
                        acc = {**acc, "outer": add(acc["outer"], e_vjp(cot["x"])[0])}
                    else:
                        y = cot["x"].astype(no_send.dtype)
                elif kind == "W":
                    mine = jax.tree.map(lambda b: b[inp][:n], buf["tape"])
                    g_w = ops.weights(lay, mine, scales_of(stage, n))
                    acc = {**acc, "layers": add(acc["layers"], g_w, row0, n)}
"""
ZB_FUSED = """\
                    if split:        # the weight gradients at once, in B
                        g_w = ops.weights(lay, cot["taps"], scales_of(stage, n))
                        acc = {**acc, "layers": add(acc["layers"], g_w, row0, n)}
                    if first:
                        _, e_vjp = jax.vjp(lambda o: embed(o, mb), outer)
                        acc = {**acc, "outer": add(acc["outer"], e_vjp(cot["x"])[0])}
                    else:
                        y = cot["x"].astype(no_send.dtype)
                elif kind == "W":
                    pass
"""

BREAKS: list[Break] = [
    Break("host-adamw-bias", "host AdamW (plan.offload_update=host)",
          "the moments used without their bias corrections",
          "jaxscale/strategies/offload/host_adam.py",
          "u = (mu / s.bc1) / (np.sqrt(nu / s.bc2) + F32(optim.eps))",
          "u = mu / (np.sqrt(nu) + F32(optim.eps))",
          (OFFLOAD_TIERS + "test_host_update_steps_are_the_device_updates",
           OFFLOAD_TIERS + "test_delayed_update_reads_parameters_one_step_stale")),
    Break("host-adamw-step", "host AdamW (plan.offload_update=host)", "three times the step",
          "jaxscale/strategies/offload/host_adam.py", "u = s.step_size * u",
          "u = 3 * s.step_size * u",
          (OFFLOAD_TIERS + "test_host_update_steps_are_the_device_updates",
           OFFLOAD_TIERS + "test_delayed_update_reads_parameters_one_step_stale")),
    Break("grad-sync-per-micro-batch", "gradient sync once per step (plan.grad_sync=auto)",
          "the replicated axes reduced every micro-batch",
          "jaxscale/strategies/common.py",
          'if max(1, spec.accumulate) > 1 and mode != "microbatch":',
          'if max(1, spec.accumulate) > 1 and mode == "step":',
          (T + "test_grad_sync.py::test_the_replicated_reduction_runs_once_after_the_micro_batch"
           "_loop",)),
    Break("compression-cast-plain", "int8/fp8/bf16 gradient compression",
          "the gradients averaged by a plain fp32 all-reduce",
          "jaxscale/strategies/compression/methods.py",
          """        return allreduce_cast(grads, axes, method, block=params.get("block", 256),
                              pad=params.get("pad", True)), state""",
          "        return allreduce_mean(grads, axes), state",
          (COMPRESSION + "test_plan_compression_tracks_one_device_and_its_census_is_the_formula",)),
    Break("powersgd-plain", "PowerSGD gradient compression",
          "the gradients averaged by a plain fp32 all-reduce",
          "jaxscale/strategies/compression/methods.py",
          'return powersgd.powersgd_mean(grads, state, axes, params["rank"])',
          "return allreduce_mean(grads, axes), state",
          (COMPRESSION + "test_plan_compression_tracks_one_device_and_its_census_is_the_formula",)),
    Break("diloco-no-outer-step", "DiLoCo's outer optimizer (plan.local_sgd=diloco)",
          "the anchor left where it was at an average",
          "jaxscale/strategies/local_sgd/averaging.py",
          "new = jax.tree.map(lambda a, u: (a.astype(jnp.float32) + u).astype(a.dtype), anchor,"
          " updates)",
          "new = anchor",
          (LOCAL_SGD + "test_diloco_through_powersgd_moves_the_anchor_by_a_rank_r_change",)),
    Break("diloco-compression-plain", "compression of DiLoCo's outer average",
          "the replicas' changes averaged by a plain fp32 all-reduce",
          "jaxscale/strategies/local_sgd/replicas.py",
          '    if spec.compression == "none":\n        return None',
          "    return None",
          (LOCAL_SGD + "test_diloco_through_powersgd_moves_the_anchor_by_a_rank_r_change",)),
    Break("streaming-diloco-blocking", "Streaming DiLoCo (plan.outer_fragments)",
          "the whole model averaged every H steps, as blocking DiLoCo",
          "jaxscale/strategies/local_sgd/replicas.py",
          "part = stream_parts(spec, ctx, outer, n, mean) if spec.outer_fragments > 1 or delay "
          "else None",
          "part = None",
          (T + "test_local_sgd_streaming.py::test_each_fragment_is_averaged_at_its_offset",)),
    Break("host-offload-on-device", "host offload (plan.offload=optimizer+master)",
          "the offloaded state left in device memory", "jaxscale/strategies/offload/__init__.py",
          'HOST = "pinned_host"', 'HOST = "device"',
          (T + "test_offload.py::test_streamed_step_equals_the_whole_update_and_skips_alike",)),
    Break("nvme-in-ram", "the NVMe tier (plan.offload_tier=nvme)",
          "the offloaded state kept in host RAM, nothing on disk",
          "jaxscale/strategies/offload/driver.py",
          "self.store = (Store(self.spec.offload_dir, self.leaves) if self.nvme",
          "self.store = (Store(self.spec.offload_dir, self.leaves) if False",
          (OFFLOAD_TIERS + "test_nvme_steps_are_the_host_tier_steps_and_move_the_formula_bytes",)),
    Break("rollback-restores-init", "spike rollback (train.spike_policy=rollback)",
          "the step count restored, the weights the initial ones",
          "jaxscale/train/spikes.py",
          "state, step = setup.adopt(state), good[-1]",
          "state, step = setup.init_state(), good[-1]",
          (T + "test_spikes.py::test_rollback_skips_the_window_and_equals_a_run_without_it",)),
    Break("resume-replays-the-stream", "exactly-once data across a resume and a dp change",
          "the stream replayed from its start to the checkpoint's step",
          "jaxscale/train/loop.py",
          'train_b.restore(meta["data_state"])', "pass",
          (T + "test_streaming.py::test_a_streamed_run_resumes_from_the_data_state_in_its_"
           "checkpoint",)),
    # ------------------------------------------------------------------ pipeline and experts
    Break("pp-ep-experts-whole", "pipeline x expert parallelism",
          "the experts left whole (not split over ep) inside the pipeline's stages",
          "jaxscale/strategies/ep/__init__.py",
          '    if spec.deg("ep") > 1:\n        rules.add("experts", "ep", by="ep")',
          '    if spec.deg("ep") > 1 and spec.deg("pp") == 1:\n'
          '        rules.add("experts", "ep", by="ep")',
          (STAGES + "[MoE pp2 x dp2 x ep2]", STAGES + "[MoE pp2 x ep2 x tp2]")),
    Break("dropless-replicated", "the dropless bounded exchange (model.moe_dropless)",
          "the experts gathered over ep, no token exchange",
          "jaxscale/strategies/ep/grouped.py",
          '    col, row = rules.spec(("experts", "embed", "mlp")), '
          'rules.spec(("experts", "mlp", "embed"))',
          '    ex = ()\n    col, row = rules.spec((None, "embed", "mlp")), '
          'rules.spec((None, "mlp", "embed"))',
          (STAGES + "[MoE pp2 x dp2 x ep2 dropless]",
           T + "test_moe_shapes.py::test_bounded_exchange_moves_the_routed_volume_times_its_"
           "factor[1.0]")),
    Break("uneven-stages-padded", "uneven pipeline stages (plan.stage_layers)",
          "every stage computing its whole padded block",
          "jaxscale/strategies/pp/program.py",
          "key = (op.kind, schedule.chunk_of(s) * rows, counts[s], s == 0, s == S - 1)",
          "key = (op.kind, schedule.chunk_of(s) * rows, rows, s == 0, s == S - 1)",
          (STAGES + "[uneven 3+1]", STAGES + "[uneven 2+3 ZB-H1]")),
    Break("zero-bubble-w-fused", "zero-bubble schedules' W pass (ZB-H1, ZB-V)",
          "the weight gradients computed in B, W doing nothing",
          "jaxscale/strategies/pp/engine.py", ZB_SPLIT, ZB_FUSED,
          (STAGES + "[uneven 2+3 ZB-H1]",)),
    Break("pp-cp-allgather", "context parallelism inside pipeline stages",
          "plan and formula both falling back to the all-gather method under a pipeline",
          "jaxscale/plan.py",
          "                   **{k: getattr(cfg.plan, k) for k in OPTIONS})",
          "                   **{**{k: getattr(cfg.plan, k) for k in OPTIONS},\n"
          '                      **({"context": "allgather"} if mesh.pp > 1 else {})})',
          (FAMILIES + "[pp2 x sp2 x tp2 ring]", FAMILIES + "[pp2 x sp2 x tp2 Ulysses]")),
    Break("restore-loads-nothing", "restore under another layout",
          "the restored weights a fresh initialisation's, the step count kept",
          "jaxscale/train/checkpoint.py",
          "    state = disk.from_disk(state, abstract_state, layer_order)\n",
          "    state = disk.from_disk(state, abstract_state, layer_order)\n"
          "    from jaxscale.train.setup import build as _build\n"
          "    _fresh = _build(cfg).init_state()\n"
          '    state = __import__("dataclasses").replace(state, params=_fresh.params, '
          "master=_fresh.master)\n",
          (T + "test_pipeline_stages.py::test_a_checkpoint_restores_under_another_layout",
           T + "test_pipeline.py::test_checkpoint_from_interleaved_pp2_restores_at_pp1")),
    Break("routing-bias-ignored", "the routing bias (model.moe_bias_rate)",
          "the bias never added to the routing scores", "models/moe.py",
          "    scores = probs if bias_E is None else probs + "
          "lax.stop_gradient(bias_E).astype(F32)",
          "    scores = probs",
          (T + "test_moe_shapes.py::test_routing_bias_steps_by_the_sign_of_the_load",)),
    Break("routing-bias-weights", "the routing bias (model.moe_bias_rate)",
          "the top-k weights read from the biased scores, not the probabilities",
          "models/moe.py", "    top_p, idx = top_k(scores, k, probs)",
          "    top_p, idx = top_k(scores, k)",
          (T + "test_moe_shapes.py::test_routing_bias_steps_by_the_sign_of_the_load",)),
    # ------------------------------------------------------------------ asynchronous server
    Break("ps-worker-synchronous", "the asynchronous parameter server",
          "a worker computing on freshly pulled parameters (no staleness)",
          "jaxscale/ps/worker.py",
          "arrays, loss, tokens, used = self.compute(params, self.position)",
          "arrays, loss, tokens, used = self.compute(self.pull()[1], self.position)",
          (PS + "test_equal_workers_in_turn_are_n_minus_1_stale_and_compute_on_what_they_pulled",
           )),
    Break("ps-staleness-dropped", "the asynchronous parameter server",
          "every push counted as fresh", "jaxscale/ps/server.py",
          "stale = self.step - int(pulled_step)", "stale = 0",
          (PS + "test_a_slow_worker_is_staler_and_its_pushes_are_weighted_by_staleness",)),
    Break("ps-scale-unapplied", "the asynchronous parameter server",
          "the staleness scale recorded but not applied", "jaxscale/ps/server.py",
          "self.state = self.apply(self.state, pushed, np.float32(scale),",
          "self.state = self.apply(self.state, pushed, np.float32(1.0),",
          (PS + "test_a_slow_worker_is_staler_and_its_pushes_are_weighted_by_staleness",)),
    # ------------------------------------------------------------------ faults and restarts
    Break("elastic-restart-fresh", "elastic restart (jaxscale launch --elastic)",
          "the restart starting the run over instead of resuming",
          "jaxscale/launch/restarts.py", "cmd = resumed(command, step)",
          "cmd = resumed(command, None)",
          (T + "test_supervise.py::test_elastic_restarts_on_one_process_fewer_on_the_nearest_"
           "mesh",)),
    Break("position-unchecked", "resume from a checkpoint",
          "a malformed data position accepted, failing at the first batch",
          "jaxscale/train/checkpoint.py", "    bad = position_problems(meta)\n",
          "    bad = []\n",
          (FAULTS + "test_malformed_position_is_refused_and_the_run_directory_is_unchanged",)),
    Break("write-failure-unnamed", "a checkpoint directory that fills up",
          "Orbax's tracebacks and logs, the cause buried", "jaxscale/train/checkpoint.py",
          "        owner.failures.append(text)\n        return False\n",
          "        owner.failures.append(text)\n        return True\n",
          (FAULTS + "test_full_checkpoint_directory_is_named_and_the_intact_checkpoint_resumes_"
           "exactly",)),
    Break("host-tier-saved-view", "the host tier's checkpointed state",
          "the saved state a view of the RAM store that later updates rewrite",
          "jaxscale/strategies/offload/driver.py",
          "jax.device_put(np.array(self.store.read(k)), s)",
          "jax.device_put(self.store.read(k), s)",
          (OFFLOAD_TIERS + "test_the_state_a_checkpoint_saves_does_not_change_with_later_steps",)),
]


def markdown() -> str:
    """The table `tests/README.md` holds: capability, the fallback ruled out, the test."""
    rows = ["| capability | the fallback ruled out | break | caught by |", "|---|---|---|---|"]
    for b in BREAKS:
        tests = "<br>".join(f"`{t.removeprefix(T)}`" for t in b.tests)
        rows.append(f"| {b.capability} | {b.fallback} | `{b.name}` | {tests} |")
    return "\n".join(rows) + "\n"


def copy_tree(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split("\n")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    # the installed layout: models/, meshes/ and benchmarks/ are jaxscale.models etc.
    for sub in ("models", "meshes", "benchmarks"):
        (dest / "jaxscale" / sub).symlink_to(dest / sub, target_is_directory=True)
    return dest


def apply(b: Break, tree: Path) -> None:
    path = tree / b.file
    text = path.read_text()
    n = text.count(b.old)
    if n != 1:
        raise SystemExit(f"break {b.name}: its text occurs {n} times in {b.file} (once needed);"
                         " the library changed: update the break")
    path.write_text(text.replace(b.old, b.new))


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    check = subprocess.run([sys.executable, "-c", "import jaxscale; print(jaxscale.__file__)"],
                           cwd=tree, env=env, capture_output=True, text=True)
    if not check.stdout.startswith(str(tree)):
        raise SystemExit(f"the copy's library is not the one imported: {check.stdout}"
                         f"{check.stderr}")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                        "-x", *tests], cwd=tree, env=env, capture_output=True, text=True)
    return p.returncode, (p.stdout + p.stderr)


def _summary(out: str) -> str:
    """pytest's last line, and the first assertion line of the failure (what caught it)."""
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    why = next((ln.strip()[1:].strip() for ln in lines if ln.startswith("E ")), "")
    return (lines[-1] if lines else "") + (f" | {why[:110]}" if why else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", help="a break's name (repeatable)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print tests/README.md's table")
    ap.add_argument("--clean", action="store_true", help="first run the tests unbroken")
    args = ap.parse_args(argv)
    chosen = [b for b in BREAKS if not args.only or b.name in args.only]
    unknown = set(args.only or ()) - {b.name for b in BREAKS}
    if unknown:
        raise SystemExit(f"no break named {sorted(unknown)}; --list shows them")
    if args.markdown:
        print(markdown(), end="")
        return 0
    if args.list:
        for b in chosen:
            print(f"{b.name:28s} {b.capability}: {b.fallback}\n{'':28s} {', '.join(b.tests)}")
        return 0
    failed = []
    for i, b in enumerate(chosen):
        with tempfile.TemporaryDirectory(prefix="jaxscale-break-") as tmp:
            tree = copy_tree(Path(tmp))
            t0 = time.perf_counter()
            if args.clean:
                rc, out = run_tests(tree, b.tests)
                if rc != 0:
                    print(f"[{i + 1}/{len(chosen)}] {b.name}: its tests fail UNBROKEN:\n{out}")
                    failed.append(b.name)
                    continue
            apply(b, tree)
            rc, out = run_tests(tree, b.tests)
            caught = rc == 1        # 1: tests failed (2-5: interrupted, usage, collection)
            print(f"[{i + 1}/{len(chosen)}] {b.name:28s} {'caught' if caught else 'MISSED':7s}"
                  f" {time.perf_counter() - t0:6.0f} s  {_summary(out)}", flush=True)
            if not caught:
                failed.append(b.name)
                print(out[-3000:])
    print(f"{len(chosen) - len(failed)} of {len(chosen)} breaks caught"
          + (f"; missed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
