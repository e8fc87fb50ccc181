"""The suite's own rules: a skipped test and an expected failure (`xfail`) fail the session
(`tests/conftest.py`, `ZeroSkips`), with the suite's pytest-xdist setup and in one process, and
the message names the test; and the recorder of where its time goes (`tests/phases.py`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")
BODY = """
import pytest
{module}

def test_runs():
    assert 1 + 1 == 2

{mark}
def test_left_out():
    {test}
"""
#: the suite's distribution (pyproject.toml)
XDIST = ("-n", "2", "--dist", "loadfile", "--max-worker-restart=0")


def _pytest(tmp_path, *args: str, module: str = "", test: str = "pass", mark: str = ""):
    """pytest run in a subprocess on a directory holding the zero-skip part of tests/conftest.py
    (without the JAX setup above it, which each xdist worker would import) and one test file:
    `module` at its top, `test` the body of its second test and `mark` its decorator."""
    source = CONFTEST.read_text()
    (tmp_path / "conftest.py").write_text("import os\n\nimport pytest\n\n\n" +
                                          source[source.index("class ZeroSkips"):])
    (tmp_path / "test_policy_case.py").write_text(BODY.format(module=module, test=test,
                                                              mark=mark))
    env = {k: v for k, v in os.environ.items()      # not this session's worker settings
           if not k.startswith(("PYTEST_", "XDIST_", "JAXSCALE_TEST_PHASES"))}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"          # seconds each: only xdist is needed
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p",
                        "no:cacheprovider", "--rootdir", str(tmp_path), *args, str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("args", [XDIST, ("-n", "0")], ids=["xdist", "one-process"])
def test_a_skipped_test_fails_the_session_and_is_named(tmp_path, args):
    rc, out = _pytest(tmp_path, *args, test='pytest.skip("no reason to run")')
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "1 passed, 1 skipped" in out, out                     # nothing failed by itself
    assert "1 skipped, and every test must run and pass" in out, out
    assert "SKIPPED test_policy_case.py::test_left_out: no reason to run" in out, out


def test_a_module_skipped_at_collection_fails_the_session(tmp_path):
    rc, out = _pytest(tmp_path, *XDIST, module='pytest.importorskip("no_such_module_here")')
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "SKIPPED test_policy_case.py: could not import 'no_such_module_here'" in out, out


def test_the_same_file_without_the_skip_passes(tmp_path):
    rc, out = _pytest(tmp_path, *XDIST)
    assert rc == pytest.ExitCode.OK, out
    assert "2 passed" in out and "skipped" not in out, out


KNOWN = '@pytest.mark.xfail(reason="a known bug")'


@pytest.mark.parametrize("args", [XDIST, ("-n", "0")], ids=["xdist", "one-process"])
def test_an_expected_failure_fails_the_session_and_is_named(tmp_path, args):
    rc, out = _pytest(tmp_path, *args, mark=KNOWN, test="assert 1 + 1 == 3")
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "1 passed, 1 xfailed" in out, out                     # nothing failed by itself
    assert "1 expected to fail (xfail), and every test must run and pass" in out, out
    assert "XFAIL test_policy_case.py::test_left_out: a known bug" in out, out


@pytest.mark.parametrize("mark,test,named", [
    (KNOWN, "pass", "XPASS test_policy_case.py::test_left_out: a known bug"),
    ("", 'pytest.xfail("not on Tuesdays")', "XFAIL test_policy_case.py::test_left_out: not on "
                                            "Tuesdays")], ids=["xpass", "xfail-call"])
def test_an_unexpected_pass_and_an_xfail_call_fail_the_session_too(tmp_path, mark, test, named):
    rc, out = _pytest(tmp_path, *XDIST, mark=mark, test=test)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert named in out, out


def test_a_crashed_worker_fails_the_session_once_and_names_its_test(tmp_path):
    """A test that aborts its worker (XLA:CPU's fatal errors do) fails the session, named,
    once: the file is not handed to a new worker to crash it again (each restart re-ran the
    file's pending tests, and after one such crash xdist hung at the end of the suite or
    stopped on an internal error)."""
    rc, out = _pytest(tmp_path, *XDIST, module="import os", test="os.abort()")
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "crashed while running 'test_policy_case.py::test_left_out'" in out, out
    assert "1 failed, 1 passed" in out, out
    assert out.count("node down") == 1 and "replacing crashed worker" not in out, out
    assert "INTERNALERROR" not in out, out


def test_every_break_applies_names_real_tests_and_is_listed_in_the_readme():
    """`tests/breaks.py`'s fallbacks stay runnable: each one's text occurs once in the library
    (a refactor that moves it must move the break), each test it names exists, and
    `tests/README.md` holds the table they make (`python -m tests.breaks --markdown`)."""
    from tests import breaks
    root = Path(__file__).resolve().parents[1]
    for b in breaks.BREAKS:
        assert (root / b.file).read_text().count(b.old) == 1, b.name
        for node in b.tests:
            path, _, name = node.partition("::")
            assert f"def {name.split('[')[0]}(" in (root / path).read_text(), (b.name, node)
    assert breaks.markdown() in Path(__file__).with_name("README.md").read_text(), (
        "tests/README.md's table of breaks is stale: python -m tests.breaks --markdown")


def test_the_phase_recorder_sees_a_compile_and_the_summary_adds_up(tmp_path, capsys):
    """`JAXSCALE_TEST_PHASES` (tests/phases.py): a test's line holds the seconds JAX spent
    tracing, lowering and compiling its programs, by name; the summary splits the worker time
    into those and the rest."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tests import phases
    path = tmp_path / "phases.jsonl"
    rec = phases.Recorder(str(path))
    try:
        rec.pytest_runtest_setup(None)
        jax.jit(lambda x: jnp.tanh(x) * 3.0 + x.sum())(np.arange(7.0))   # a new program
        rec.pytest_runtest_logfinish("t.py::a", None)
        rec.pytest_runtest_logfinish("t.py::never_set_up", None)         # the xdist controller
    finally:
        rec.close()
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["test"] == "t.py::a" and {"seconds", "trace", "lower", "compile"} <= set(row)
    assert "jit(<lambda>)" in [name for name, _ in row["programs"]]   # events seen, not timed
    rows = [{"test": "t.py::a", "seconds": 2.0, "trace": 1.0, "programs": []},
            {"test": "u.py::b", "seconds": 10.0, "compile": 6.0, "trace": 1.0, "lower": 1.0,
             "programs": [["jit(train_step)", 6.0]]}]
    text = phases.summary(rows)
    assert text.splitlines()[:5] == ["2 tests, 0.2 min of worker time",
                                     "  trace                 0.0 min  16.7%",
                                     "  lower                 0.0 min   8.3%",
                                     "  compile               0.1 min  50.0%",
                                     "  run and the rest      0.1 min  25.0%"]
    assert "jit(train_step)" in text and "u.py" in text
    assert phases.main([str(path)]) == 0 and "1 tests" in capsys.readouterr().out
    assert phases.main([str(tmp_path / "none.jsonl")]) == 2
