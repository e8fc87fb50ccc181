"""Models: logical axes and checkpoint_name tags only."""
from jaxscale.models.llama import Llama, ModelConfig, RopeScaling, TAGS  # noqa: F401
from jaxscale.models.configs import CONFIGS, get  # noqa: F401
