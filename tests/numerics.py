"""The numerics harness lives in the library (`jaxscale.analysis.harness`: the composition check
of generated layouts runs it too); the tests import it from here."""
from jaxscale.analysis.harness import *  # noqa: F401,F403
