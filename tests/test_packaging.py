"""Packaging: models/, meshes/ and benchmarks/ live inside the jaxscale namespace, installed or
run from the source tree; experiments are plain scripts that import only the library."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, cwd, **env) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **env})


def test_no_top_level_models_or_meshes_package(tmp_path):
    r = _python("import importlib.util as u; print([n for n in ('models', 'meshes', "
                "'benchmarks') if u.find_spec(n)])", tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_source_tree_without_install_finds_the_namespaced_packages(tmp_path):
    """As on a machine with no registry: PYTHONPATH=<tree>, no editable-install finder."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if 'Editable' not in repr(f)]; import jaxscale.models.configs as c, "
            "jaxscale.meshes as m; print(c.__file__, m.get('cpu8').tp)")
    r = _python(code, tmp_path, PYTHONPATH=str(ROOT))
    assert r.returncode == 0, r.stderr
    assert str(ROOT / "models" / "configs.py") in r.stdout and r.stdout.split()[-1] == "2"


def test_experiments_import_only_the_library_and_their_shared_setup():
    from jaxscale.config import list_experiments
    assert "_common" not in list_experiments() and "llama_tiny" in list_experiments()
    for path in (ROOT / "experiments").glob("*.py"):
        text = path.read_text()
        assert "sys.path" not in text, path.name
        assert not re.search(r"^\s*(from|import) tests\b", text, re.M), path.name


def test_every_package_of_the_tree_is_installed():
    """A non-editable install ships the packages pyproject.toml lists: every folder of jaxscale/
    with an __init__.py is one of them."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "jaxscale").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
