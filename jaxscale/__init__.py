"""jaxscale: LLM training strategies as sharding annotations over a JAX device mesh."""
import os as _os

__version__ = "0.1.0"

# `models/`, `meshes/` and `benchmarks/` are top-level folders of the source tree, installed as
# `jaxscale.models`, `.meshes` and `.benchmarks` (pyproject's package-dir). Run from a source tree
# without installing (`PYTHONPATH=.`, as on a machine with no registry), they are found beside
# this package instead.
_tree = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_tree, "models", "llama.py")) and _tree not in __path__:
    __path__.append(_tree)
