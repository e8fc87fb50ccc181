import atexit
import os
import shutil
import subprocess
import sys
import tempfile

# 8 simulated CPU devices; must be set before jax is imported anywhere. The suite's time is XLA
# compilation of tiny programs that then run for milliseconds: the CPU backend's code generation
# at its lowest optimisation, its fusions emitted directly to LLVM IR (not through MLIR); the
# sharding propagation, SPMD partitioning, HLO passes and scheduling are the same, so the census
# is too, and compiled memory almost always: the direct emitter's fusions can hold buffers the
# other path does not (a bf16 1F1B pipeline with tp and Megatron SP, dim 96: 5.99 MB of temp
# against 6.61 with the default flags, which `jaxscale.analysis.sweep` and users compile with).
# Together they compile a step about 2x faster (the emitter flag alone about 1.4x).
# (The direct emitter may round a transcendental in the last bit differently in two differently
# partitioned programs: tests comparing two programs' random initialisations allow that.)
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_use_fusion_emitters=false")


def _fast_compile() -> str:
    """The flags of `FAST_COMPILE`, if this jaxlib knows them (XLA aborts on an unknown flag), else
    none: asked once, in a subprocess, by the session's first process; its workers inherit the
    answer."""
    if "JAXSCALE_TESTS_FAST_COMPILE" not in os.environ:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                               env={**os.environ, "XLA_FLAGS": " ".join(FAST_COMPILE),
                                    "JAX_PLATFORMS": "cpu"}, capture_output=True)
        os.environ["JAXSCALE_TESTS_FAST_COMPILE"] = (" ".join(FAST_COMPILE)
                                                     if probe.returncode == 0 else "")
    return os.environ["JAXSCALE_TESTS_FAST_COMPILE"]


if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""),
                                                   "--xla_force_host_platform_device_count=8",
                                                   _fast_compile()) if f)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests compile the same program (the same plan's init and step on the same tiny model): one
# compilation cache for the session, shared by the pytest-xdist workers (they inherit this
# process's environment), so each program compiles once. Set JAX_COMPILATION_CACHE_DIR to keep one
# across sessions.
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxscale-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# ----------------------------------------------------------------------------- zero skips
# (tests/test_suite_policy.py runs the class and the hook below in a pytest of its own)
class ZeroSkips:
    """Every test runs and passes in CI: a skipped test (`pytest.skip`, `skipif`,
    `importorskip`, a module skipped at collection) and an expected failure (`xfail`, as a
    mark or a call, whether it then fails or passes) fail the session, which names each one.
    They are counted where the session ends: in this process with `-n 0`, on the pytest-xdist
    controller otherwise (workers forward every test report and each skipped collection to it;
    only its exit status counts)."""

    def __init__(self):
        self.skipped: list[str] = []
        self.xfailed: list[str] = []

    def _record(self, report) -> None:
        why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        if hasattr(report, "wasxfail"):
            kind = "XPASS" if report.passed else "XFAIL"
            self.xfailed.append(f"{kind} {report.nodeid}: "
                                f"{str(report.wasxfail).removeprefix('reason: ')}")
        elif report.skipped:
            self.skipped.append(f"{report.nodeid}: {str(why).removeprefix('Skipped: ')}")

    def pytest_runtest_logreport(self, report):
        self._record(report)

    def pytest_collectreport(self, report):
        self._record(report)

    def pytest_sessionfinish(self, session, exitstatus):
        if (self.skipped or self.xfailed) and exitstatus in (pytest.ExitCode.OK,
                                                             pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if not (self.skipped or self.xfailed):
            return
        counts = [f"{len(x)} {what}" for x, what in ((self.skipped, "skipped"),
                                                      (self.xfailed, "expected to fail (xfail)"))
                  if x]
        terminalreporter.write_sep("=", f"{' and '.join(counts)}, and every test must run and "
                                        "pass (tests/conftest.py: ZeroSkips)", red=True)
        for line in self.skipped:
            terminalreporter.write_line(f"SKIPPED {line}", red=True)
        for line in self.xfailed:
            terminalreporter.write_line(line, red=True)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):          # not on an xdist worker
        config.pluginmanager.register(ZeroSkips(), "jaxscale-zero-skips")
    if os.environ.get("JAXSCALE_TEST_PHASES"):      # where the time goes (tests/phases.py)
        from tests.phases import Recorder
        config.pluginmanager.register(Recorder(os.environ["JAXSCALE_TEST_PHASES"]),
                                      "jaxscale-phases")


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores (at most 4). Many of the suite's tests run
    `jaxscale` in subprocesses (multi-process runs, faults, the CLI) and wait for them; a spare
    worker compiles meanwhile instead of leaving a core idle."""
    return min(4, (os.cpu_count() or 1) + 1)
