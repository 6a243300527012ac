"""Language models over any recipe: `LM`, `LMConfig`, cached generation, checkpoints."""

from .checkpoint import CheckpointError
from .config import ConfigError, LMConfig, recipe_from_json, recipe_to_json
from .lm import LM, GenerationError, LMState, sample_next

__all__ = ["LM", "LMConfig", "LMState", "ConfigError", "CheckpointError", "GenerationError", "sample_next",
           "recipe_to_json", "recipe_from_json"]
