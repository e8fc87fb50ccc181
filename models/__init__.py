"""Models: logical axes and checkpoint_name tags only. `Llama` and the published configs
(`get(name)`, `CONFIGS`) are the package's face."""
from jaxscale.models.configs import CONFIGS, get
from jaxscale.models.llama import Llama

__all__ = ["CONFIGS", "Llama", "get"]
