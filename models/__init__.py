"""Models: logical axes and checkpoint_name tags only."""
from models.llama import Llama, ModelConfig, RopeScaling, TAGS  # noqa: F401
from models.configs import CONFIGS, get  # noqa: F401
