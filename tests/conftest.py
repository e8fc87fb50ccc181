import os

# 8 simulated CPU devices; must be set before jax is imported anywhere.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# ----------------------------------------------------------------------------- zero skips
# (tests/test_suite_policy.py runs the class and the hook below in a pytest of its own)
class ZeroSkips:
    """Every test runs in CI: a skipped test (`pytest.skip`, `skipif`, `importorskip`, a module
    skipped at collection) fails the session, which names each one. Skips are counted where the
    session ends: in this process with `-n 0`, on the pytest-xdist controller otherwise (workers
    forward every test report and each skipped collection to it; only its exit status counts). An
    expected failure (`xfail`) ran, so it is not a skip."""

    def __init__(self):
        self.skipped: list[str] = []

    def _record(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
            self.skipped.append(f"{report.nodeid}: {str(why).removeprefix('Skipped: ')}")

    def pytest_runtest_logreport(self, report):
        self._record(report)

    def pytest_collectreport(self, report):
        self._record(report)

    def pytest_sessionfinish(self, session, exitstatus):
        if self.skipped and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.skipped:
            terminalreporter.write_sep("=", f"{len(self.skipped)} skipped, and every test must "
                                            "run (tests/conftest.py: ZeroSkips)", red=True)
            for line in self.skipped:
                terminalreporter.write_line(f"SKIPPED {line}", red=True)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):          # not on an xdist worker
        config.pluginmanager.register(ZeroSkips(), "jaxscale-zero-skips")
