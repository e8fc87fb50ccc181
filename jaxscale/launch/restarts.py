"""Supervised launches: restart a failed or hung run from its last checkpoint, on the same
processes or (elastic) on those left.

`launch(command, processes, ..., max_restarts=N, elastic=False, run=Run(...))` runs one attempt
(`jaxscale.launch.group.run_group`) and, while restarts are left, reruns the same command after:
- a process that died (exit status other than 0 and 2, or killed by a signal);
- a hang (no step within the hang limit; every process's stacks are dumped first).
A restart adds `--resume` when a finalized checkpoint exists (else it starts from scratch
without it), uses a fresh coordinator port, and logs "restart k of N after <cause>" and the
checkpoint step it resumes from. Not restarted: status 2 (the command itself was refused: bad
input would be refused again), and any failure after SIGTERM/SIGINT reached the launcher. Past N
restarts the launcher exits with the last failure's status and says so.

`elastic=True`: after a process died, the restart runs on one process fewer (on one machine a
lost host is one process fewer, each with the same local devices), on the mesh
`jaxscale.launch.elastic.choose_mesh` picks for the devices left (named in the log, passed as
`--set mesh.X=..`). The global batch stays the same, so data.batch_size must divide by the new
process count; where it does not, or no mesh fits, the launcher says so and stops. A hang keeps
the process count (nothing says which host is gone).
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from jaxscale.launch.distributed import HEARTBEAT_TIMEOUT_S, free_port
from jaxscale.launch.group import EXIT_GRACE_S, Outcome, Watch, run_group
from jaxscale.train import checkpoint_meta
from jaxscale.train.supervise import EXIT_STOPPED

NOT_RESTARTED = {2: "the command was refused (bad input), and would be refused again",
                 EXIT_STOPPED: "the run stopped on purpose (train.nonfinite=stop, or more loss "
                               "spikes than train.max_rollbacks), and would stop again"}


@dataclass
class Run:
    """What the launcher knows of the run it supervises (from the command's config)."""
    out: Path                   # run directory: heartbeats, stacks
    checkpoints: Path           # where finalized checkpoints appear
    cfg: object = None          # jaxscale.config.Config (elastic: the mesh and the batch)
    hang_min_s: float = 300.0

    @classmethod
    def of(cls, cfg, out: str | None = None) -> "Run":
        from jaxscale.config import run_directory
        d = Path(run_directory(cfg, out))
        return cls(d, checkpoint_meta.directory_for(cfg, d), cfg, cfg.train.hang_min_s)


def _say(msg: str) -> None:
    print(f"jaxscale launch: {msg}", file=sys.stderr, flush=True)


def check_arguments(command: list[str], processes: int, max_restarts: int,
                    elastic: bool) -> None:
    if processes < 1:
        raise ValueError(f"--processes must be >= 1, got {processes}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    if not command or command[0] != "train":
        raise ValueError("give the command to run after --, e.g. "
                         "`jaxscale launch --processes 2 -- train llama_tiny --steps 20`")
    if elastic and processes < 2:
        raise ValueError("--elastic restarts on the processes left after one is lost, so it "
                         f"needs --processes 2 or more (got {processes})")
    if elastic and max_restarts < 1:
        raise ValueError("--elastic acts on a restart: give --max-restarts N (N >= 1) too")


def resumed(command: list[str], checkpoint: int | None) -> list[str]:
    """The command with `--resume` when there is a checkpoint to resume, without it otherwise."""
    plain = [a for a in command if a != "--resume"]
    return plain + ["--resume"] if checkpoint is not None else plain


def launch(command: list[str], processes: int = 2, local_devices: int = 4, port: int = 0,
           heartbeat: int = HEARTBEAT_TIMEOUT_S, exit_grace: float = EXIT_GRACE_S, *,
           max_restarts: int = 0, elastic: bool = False, run: Run | None = None,
           program: list[str] | None = None) -> int:
    """Run `jaxscale <command>` in `processes` local processes, restarting it up to
    `max_restarts` times; `program` replaces `python -m jaxscale.cli` (tests)."""
    check_arguments(command, processes, max_restarts, elastic)
    program = program or [sys.executable, "-m", "jaxscale.cli"]
    watch = Watch(run.out, run.hang_min_s) if run is not None else Watch()
    first_processes, n, extra, cmd, restarts = processes, processes, [], list(command), 0
    while True:
        if run is not None:
            for old in (run.out / "heartbeat").glob("process-*.json"):
                old.unlink(missing_ok=True)     # an earlier attempt's
        attempt = cmd + [a for o in extra for a in ("--set", o)]
        prefix = f"jaxscale launch --processes {n} --local-devices {local_devices} --"
        outcome = run_group(program + attempt, n, local_devices, port or free_port(), heartbeat,
                            prefix, watch, exit_grace, _say, label=shlex.join(attempt))
        port = 0                                # a fresh coordinator port for every restart
        if outcome.status == 0:
            if restarts:
                _say(f"finished after {restarts} restart(s)")
            return 0
        step = checkpoint_meta.scan(run.checkpoints).latest if run is not None else None
        stop = _why_not_restart(outcome, restarts, max_restarts, step)
        if stop:
            _say(f"error: {stop}")
            return outcome.status
        restarts += 1
        note = ""
        if elastic and outcome.lost is not None:
            try:
                n, extra, note = _shrink(run, n, first_processes, local_devices)
            except ValueError as e:
                _say(f"error: elastic restart stopped after {outcome.cause}: {e}")
                return outcome.status
        cmd = resumed(command, step)
        where = (f"resuming from checkpoint step {step} ({run.checkpoints / str(step)})"
                 if step is not None else "no checkpoint yet: starting from scratch")
        _say(f"restart {restarts} of {max_restarts} after {outcome.cause}; {where}")
        if note:
            _say(f"elastic: process {outcome.lost} is lost; {note}")


def _why_not_restart(outcome: Outcome, restarts: int, max_restarts: int,
                     step: int | None) -> str | None:
    if outcome.signalled:
        return (f"{outcome.cause or 'the processes stopped'} after a signal to the launcher: "
                f"not restarted (status {outcome.status})")
    if outcome.status in NOT_RESTARTED:
        return (f"{outcome.cause}: not restarted, as {NOT_RESTARTED[outcome.status]}; fix the "
                f"command and run it again")
    if restarts >= max_restarts:
        tried = (f"giving up after {restarts} restart(s) (--max-restarts {max_restarts})"
                 if max_restarts else "not restarted (--max-restarts 0)")
        again = (f"the latest finalized checkpoint is step {step}: rerun the same command with "
                 f"--resume" if step is not None else
                 "no checkpoint was finalized: rerun the same command")
        return (f"{tried}; the last failure: {outcome.cause} (status {outcome.status}); {again}"
                + (" (or with --max-restarts N to restart by itself)" if not max_restarts
                   else ""))
    return None


def _shrink(run: Run | None, n: int, first: int, local_devices: int):
    """(processes, mesh overrides, note) for a restart on one process fewer."""
    if n <= 1:
        raise ValueError("no process is left to restart on")
    m = n - 1
    if run is None or run.cfg is None:
        return m, [], f"restarting on {m} process(es)"
    batch = run.cfg.data.batch_size
    if batch % m:
        raise ValueError(f"data.batch_size={batch} does not divide among {m} processes (the "
                         f"global batch stays the same; each process takes batch_size / "
                         f"processes rows). Use a batch size divisible by every process count "
                         f"the run may shrink to, or restart by hand with another batch size")
    from jaxscale.launch.elastic import choose_mesh
    choice = choose_mesh(run.cfg, m * local_devices, m, first * local_devices, first)
    was = run.cfg.mesh.resolve(first * local_devices).degrees()
    return m, choice.overrides, f"restarting on {m} process(es): {choice.describe(was)}"

