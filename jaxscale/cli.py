"""`jaxscale train | inspect | plan | profile | bench | launch | tokenizer train | data prepare`."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from jaxscale.fields import arg
from jaxscale.hardware import simulate_cpu_devices


def _load(args, out=None, checkpoints: bool = False, data: bool = False):
    """The experiment's config with `--set` overrides (and train's `--steps`), checked before
    anything runs: every field's range, the relations between fields and, for a command that
    writes into the directory `out(cfg)`, the output, checkpoint and data paths; all problems in
    one ValueError (exit 2)."""
    from jaxscale import config as config_lib
    from jaxscale import fields
    cfg = config_lib.load_experiment(args.experiment)
    cfg, errs = config_lib.apply_each(cfg, args.set)
    if args.command == "train" and args.steps is not None:     # shorthand for train.steps
        bad = fields.check(config_lib.TrainConfig, "steps", args.steps, "train.steps",
                           via="--steps")
        if bad:
            errs.append(bad)
        else:
            cfg = config_lib.apply_overrides(cfg, [f"train.steps={args.steps}"])
    errs += config_lib.check(cfg)
    if out is not None:
        key = "--out" if args.out else "train.out" if (
            args.command == "train" and cfg.train.out) else "output directory"
        errs += config_lib.path_problems(cfg, out(cfg), key, checkpoints=checkpoints, data=data)
    fields.raise_problems(errs)
    return cfg


def _train_out(args):
    """train's run directory (`jaxscale.config.run_directory`)."""
    from jaxscale.config import run_directory
    return lambda cfg: run_directory(cfg, args.out)


def _resume_command(args) -> str:
    """The command line that resumes this run (under `jaxscale launch` when launched by it)."""
    parts = ["train", args.experiment, *[a for s in args.set for a in ("--set", s)]]
    parts += ["--plan", args.plan] if args.plan != "config" else []
    parts += ["--steps", str(args.steps)] if args.steps is not None else []
    parts += ["--out", args.out] if args.out else []
    prefix = os.environ.get("JAXSCALE_LAUNCH_PREFIX", "jaxscale")
    return f"{prefix} {shlex.join(parts)} --resume"


def cmd_train(args) -> int:
    from jaxscale.launch import initialize_from_env
    initialize_from_env()
    from jaxscale.train.loop import TrainingStopped, train
    cfg = _load(args, out=_train_out(args), checkpoints=True, data=True)
    cfg, record = _plan_auto(args, cfg)
    try:
        summary = train(cfg, out=args.out, resume=args.resume,
                        resume_command=_resume_command(args))
    except TrainingStopped as e:
        from jaxscale.train.supervise import EXIT_STOPPED
        print(f"jaxscale train: error: {e}", file=sys.stderr)
        return EXIT_STOPPED
    import jax
    if jax.process_index() == 0:
        if record is not None:          # the choice beside the run's own summary
            from pathlib import Path
            summary["plan_auto"] = record
            (Path(summary["out"]) / "summary.json").write_text(json.dumps(summary, indent=2)
                                                               + "\n")
        print(json.dumps(summary, indent=2))
    return 0


def _plan_auto(args, cfg):
    """`--plan auto`: (the chosen plan's config, the record of the choice), printed; else
    (cfg, None)."""
    if args.plan != "auto":
        return cfg, None
    import jax

    from jaxscale.analysis import autoplan
    fixed = [k for k in autoplan.FIXABLE if any(s.split("=", 1)[0].strip() == f"plan.{k}"
                                                for s in args.set)]
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) \
        if jax.process_index() == 0 else None
    cfg, record = autoplan.choose(cfg, fixed=fixed, say=say)
    if say:
        say(autoplan.format_record(record))
    return cfg, record


def cmd_launch(args) -> int:
    from jaxscale.launch import Run, launch
    from jaxscale.launch.restarts import check_arguments
    command = args.command_argv[1:] if args.command_argv[:1] == ["--"] else args.command_argv
    if args.async_ is not None:
        return _launch_async(args, command)
    check_arguments(command, args.processes, args.max_restarts, args.elastic)
    # check the command here, before any process starts
    inner = parser().parse_args(command)
    cfg = _load(inner, out=_train_out(inner), checkpoints=True, data=True)
    return launch(command, processes=args.processes, local_devices=args.local_devices or 4,
                  port=args.port, heartbeat=args.heartbeat_timeout,
                  max_restarts=args.max_restarts, elastic=args.elastic,
                  run=Run.of(cfg, inner.out))


def _launch_async(args, command: list[str]) -> int:
    """`launch --async N`: a parameter server and N workers (`jaxscale.ps`)."""
    from jaxscale.ps import supervisor
    if args.async_ < 1:
        raise ValueError(f"--async needs a worker count >= 1, got {args.async_}")
    if not command or command[0] != "train":
        raise ValueError("give the training command after --, e.g. `jaxscale launch --async 4 "
                         "-- train llama_tiny --steps 100`")
    inner = parser().parse_args(command)
    cfg = _load(inner, out=_train_out(inner), checkpoints=True, data=True)
    from jaxscale import fields
    fields.raise_problems(cfg.ps.worker_problems(args.async_))
    from jaxscale.config import run_directory
    return supervisor.run(cfg, run_directory(cfg, inner.out), args.async_, args.port,
                          inner.resume, local_devices=args.local_devices or 1,
                          max_restarts=max(args.max_restarts, 3))


def cmd_inspect(args) -> int:
    from jaxscale.analysis import inspect
    cfg, record = _plan_auto(args, _load(args))
    rep = inspect.report(cfg)
    if record is not None:
        rep["plan_auto"] = record
    print(json.dumps(rep, indent=2) if args.json else inspect.format_report(rep))
    return 0


def cmd_profile(args) -> int:
    from jaxscale.analysis import profiling
    cfg = _load(args, out=lambda c: args.out or f"runs/{c.name}_profile", data=True)
    res = profiling.profile(cfg, steps=args.steps, out=args.out)
    print(profiling.format_table(res))
    print(f"trace, memory.prof, live_arrays.jsonl, memory_timeline.png in {res['out']}")
    return 1 if res["leak"] else 0


def cmd_bench(args) -> int:
    if args.what == "collectives":
        from jaxscale.comm import bench
        return bench.main(args.rest)
    raise ValueError(f"unknown benchmark {args.what!r}; valid: collectives")


def _count(text: str) -> int | None:
    """A count such as 4096, 16e6 or 64e3 (no fractions)."""
    f = float(text)
    return int(f) if f.is_integer() else None


def _human(n: float) -> str:
    return next(f"{n / 1024**i:.1f} {u}" for i, u in enumerate(["B", "KiB", "MiB", "GiB", "TiB"])
                if n < 1024 ** (i + 1) or u == "TiB")


def cmd_tokenizer(args) -> int:
    """`jaxscale tokenizer train`: a byte-level BPE on local text, saved as tokenizer.json."""
    import time

    from jaxscale import data, fields
    from jaxscale.data import documents, tokenizer
    fields.raise_problems(data.source_problems(args.source) + [
        e for e in [fields.dir_problem(args.out, "--out")] if e])
    files = data.corpus_files(args.source)
    fields.raise_problems(documents.check_files(files, args.format, args.text_field)
                          if args.source != "stdlib" else [])
    texts = [t for _, t in documents.iter_documents(files, args.format, args.text_field,
                                                    args.max_bytes)]
    if not texts:
        raise ValueError(f"--source {args.source!r}: no text to train on")
    t0 = time.time()
    tok = tokenizer.train_bpe(texts, args.vocab, args.out)
    secs = time.time() - t0
    sample = texts[: max(1, len(texts) // 20)]
    n_bytes = sum(len(t.encode()) for t in sample)
    n_tok = sum(len(ids) for ids in tok.encode_batch(sample))
    total = sum(len(t.encode()) for t in texts)
    print(f"trained a byte-level BPE of {tok.vocab_size} tokens on {_human(total)} "
          f"({len(texts)} documents) in {secs:.1f} s: {n_bytes / max(n_tok, 1):.2f} bytes/token\n"
          f"saved {tok.path}; use it with --set data.tokenizer={tok.path} "
          f"--set model.vocab_size={-(-tok.vocab_size // 64) * 64}")
    return 0


def cmd_data(args) -> int:
    """`jaxscale data prepare`: tokenize the configured source once into shards + manifest."""
    from jaxscale import data, fields
    from jaxscale.data import documents, shards, tokenizer
    cfg = _load(args)
    out = args.out or cfg.data.shards
    errs = [] if out else ["give --out DIR or --set data.shards=DIR (where the shards go)"]
    max_bytes = args.max_bytes          # --max-bytes, or data.max_bytes given with --set
    if any(s.split("=", 1)[0].strip() == "data.max_bytes" for s in args.set):
        if max_bytes is not None and max_bytes != cfg.data.max_bytes:
            errs.append(f"--max-bytes {max_bytes} and --set data.max_bytes="
                        f"{cfg.data.max_bytes} disagree: give one of them")
        max_bytes = cfg.data.max_bytes
    errs += [e for e in [fields.dir_problem(out, "--out")] if e] if out else []
    errs += data.source_problems(cfg.data.source)
    if not errs and cfg.data.source != "stdlib":
        errs += documents.check_files(data.corpus_files(cfg.data.source), cfg.data.format,
                                      cfg.data.text_field)
    try:
        tok = tokenizer.load(cfg.data.tokenizer)
    except ValueError as e:
        errs.append(str(e))
    fields.raise_problems(errs)

    def progress(n):
        print(f"\r  {_human(n)} tokenized", end="", file=sys.stderr, flush=True)
    m = shards.prepare(data.corpus_files(cfg.data.source), tok, out, cfg.data.format,
                       cfg.data.text_field, cfg.data.heldout_fraction, args.shard_tokens,
                       max_bytes, cfg.data.source, progress=progress)
    print(file=sys.stderr)
    for split, info in m["splits"].items():
        print(f"{split:8s} {info['docs']:>9,} documents {info['n_tokens']:>13,} tokens "
              f"in {len(info['shards'])} shard(s)")
    n_tok = sum(info["n_tokens"] for info in m["splits"].values())
    print(f"{_human(m['text_bytes'])} of text -> {m['tokenizer']['kind']} tokens "
          f"({m['text_bytes'] / max(1, n_tok):.2f} bytes/token) in {m['seconds']:.1f} s; "
          f"manifest {out}/manifest.json\n"
          f"train on it with --set data.shards={out}" +
          ("" if cfg.data.tokenizer == "bytes" else f" --set data.tokenizer={cfg.data.tokenizer}"))
    return 0


def cmd_experiments(args) -> int:
    from jaxscale import gallery
    if args.action == "list":
        return gallery.list_topics()
    return gallery.run(args.names, args.all, args.out, args.limit_s or gallery.LIMIT_S,
                       publish=args.publish)


def cmd_plan(args) -> int:
    from jaxscale.planner.command import run
    return run(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxscale", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("experiment", help="name under experiments/ or path to a .py with config()")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config field, e.g. --set mesh.dp=8 "
                             "--set model.n_layers=2")
        sp.add_argument("--devices", type=arg(lo=1), default=8,
                        help="simulated CPU devices when no accelerator is present (default 8)")

    def plan_flag(sp):
        sp.add_argument("--plan", choices=("config", "auto"), default="config",
                        help="config: the configured mesh degrees and plan (default); auto: the "
                             "fastest predicted plan that fits, its compiled memory checked "
                             "before the first step, the next one where it does not fit")

    t = sub.add_parser("train", help="train an experiment")
    common(t)
    t.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    t.add_argument("--out", help="run directory (default runs/<name>)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in the run directory")
    plan_flag(t)
    t.set_defaults(func=cmd_train)
    i = sub.add_parser("inspect", help="compile the train step; report memory, census, FLOPs")
    common(i)
    i.add_argument("--json", action="store_true", help="print one JSON object")
    plan_flag(i)
    i.set_defaults(func=cmd_inspect)
    from jaxscale.planner.command import add_arguments as plan_arguments
    pl = sub.add_parser("plan", help="predict per-device memory, communication and step time "
                        "of a plan without compiling; --search ranks every plan that fits")
    plan_arguments(pl)
    pl.set_defaults(func=cmd_plan)
    pr = sub.add_parser("profile", help="trace steps; device memory profile; leak check")
    common(pr)
    pr.add_argument("--steps", type=arg(lo=5, note="2 warm-up steps, then 3 or more for the leak "
                                        "check"), default=6,
                    help="steps to run (first 2 are warm-up; at least 5)")
    pr.add_argument("--out", help="output directory (default runs/<name>_profile)")
    pr.set_defaults(func=cmd_profile)
    be = sub.add_parser("bench", help="benchmarks: collectives (nccl-tests style, JAX vs torch)")
    be.add_argument("what", help="collectives")
    be.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags (--help)")
    be.set_defaults(func=cmd_bench)
    ex = sub.add_parser("experiments", help="run the topic experiments and write their gallery "
                        "(each experiment's claims, table and figure) under --out; --publish "
                        "updates the committed experiments/README.md")
    ex_sub = ex.add_subparsers(dest="action", required=True)
    er = ex_sub.add_parser("run", help="run experiments (NN or names, or --all); exits non-zero "
                           "when one fails")
    er.add_argument("names", nargs="*", help="topic numbers (07) or script names")
    er.add_argument("--all", action="store_true", help="every experiments/NN_*.py")
    er.add_argument("--out", default="runs/experiments",
                    help="where each run writes its output and the gallery of the runs")
    er.add_argument("--publish", action="store_true",
                    help="also merge the results into the committed gallery (experiments/"
                         "README.md, gallery.json, img/)")
    er.add_argument("--limit-s", type=arg(lo=1), default=None,
                    help="stop an experiment after this many seconds (default 2x its budget)")
    er.set_defaults(func=cmd_experiments)
    el = ex_sub.add_parser("list", help="the topics, their experiments and last results")
    el.set_defaults(func=cmd_experiments)
    tk = sub.add_parser("tokenizer", help="tokenizer train: a byte-level BPE on local text "
                        "(the stdlib sources by default), saved as tokenizer.json")
    tk_sub = tk.add_subparsers(dest="action", required=True)
    tt = tk_sub.add_parser("train", help="train a byte-level BPE (Hugging Face tokenizers)")
    tt.add_argument("--vocab", type=arg(lo=259, note="256 bytes + 3 specials"), required=True,
                    help="vocabulary size, specials included (e.g. 4096)")
    tt.add_argument("--source", default="stdlib",
                    help="'stdlib' or comma-separated globs (default stdlib)")
    tt.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "parquet"),
                    help="how files hold documents (default: by suffix)")
    tt.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    tt.add_argument("--max-bytes", type=arg(lo=1, parse=_count), default=16_000_000,
                    help="text to train on, at most (default 16e6)")
    tt.add_argument("--out", default="runs/tokenizer",
                    help="directory for tokenizer.json (default runs/tokenizer)")
    tt.set_defaults(func=cmd_tokenizer)
    da = sub.add_parser("data", help="data prepare: tokenize data.source once into on-disk "
                        "shards for streamed, packed training (data.shards)")
    da_sub = da.add_subparsers(dest="action", required=True)
    dp = da_sub.add_parser("prepare", help="write token shards + manifest.json")
    common(dp)
    dp.add_argument("--out", help="shards directory (default: data.shards)")
    dp.add_argument("--shard-tokens", type=arg(lo=1, parse=_count), default=64 * 2**20,
                    help="tokens per shard file, about (default 64Mi)")
    dp.add_argument("--max-bytes", type=arg(lo=1, parse=_count), default=None,
                    help="stop after this much text (default: --set data.max_bytes=N when "
                         "given, else all of it)")
    dp.set_defaults(func=cmd_data)
    la = sub.add_parser("launch", help="run a command in several local processes "
                        "(jax.distributed, gloo), e.g. launch --processes 2 -- train llama_tiny")
    la.add_argument("--processes", type=arg(lo=1), default=2,
                    help="number of processes (default 2)")
    la.add_argument("--local-devices", type=arg(lo=1), default=None,
                    help="simulated CPU devices per process (default 4; with --async 1)")
    la.add_argument("--port", type=arg(lo=0, hi=65535), default=0,
                    help="coordinator port (default: a free one)")
    la.add_argument("--heartbeat-timeout", type=arg(lo=1), default=30,
                    help="seconds before the coordination service declares a silent process "
                         "dead and stops the others (default 30)")
    la.add_argument("--max-restarts", type=arg(lo=0), default=0,
                    help="restart the run from its last checkpoint (--resume) up to N times "
                         "after a process dies or the run hangs (train.hang_factor, "
                         "train.hang_min_s; stacks are dumped first) (default 0)")
    la.add_argument("--elastic", action="store_true",
                    help="after a process is lost, restart on one process fewer, on the same "
                         "plan where a -1 mesh degree absorbs it, else the nearest mesh that fits")
    la.add_argument("--async", dest="async_", type=int, default=None, metavar="WORKERS",
                    help="asynchronous training: a parameter server and WORKERS workers that "
                         "never wait for each other (jaxscale.ps; ps.* settings; --local-devices "
                         "per worker, default 1)")
    la.add_argument("command_argv", nargs=argparse.REMAINDER,
                    help="-- then the jaxscale command, e.g. -- train llama_tiny --steps 20")
    la.set_defaults(func=cmd_launch)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    simulate_cpu_devices(getattr(args, "devices", None) or 8)   # plan's --devices defaults to None
    try:
        return args.func(args)
    except (ValueError, KeyError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"jaxscale {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
