"""fastweights: sequence models that keep their context in a memory trained online.

One model = one Recipe on four axes (memory, objective, optimizer, retention); every recipe gets
every form that exists for it: `recurrent` (exact, per token), `parallel` (matrix form),
`chunk` (chunkwise-parallel training form).
"""

from .api import (
    BackendNotAvailable,
    FormNotAvailable,
    backends,
    chunk,
    forms,
    layer_op_backends,
    layer_op_pipeline,
    parallel,
    pipeline,
    recipe_class,
    recurrent,
)
from .inputs import InputError, example_inputs, init_state
from .recipe import FeatureMap, Memory, Objective, Optimizer, Recipe, RecipeError, Retention
from .stability import DivergenceError
from .state import KVCache, MemoryState, MesaState
from .zoo import ZOO, UnknownModelError

__version__ = "0.1.0"

__all__ = [
    "recurrent", "parallel", "chunk", "forms", "backends", "layer_op_backends", "pipeline", "layer_op_pipeline",
    "recipe_class", "FormNotAvailable",
    "BackendNotAvailable",
    "InputError", "DivergenceError", "example_inputs", "init_state",
    "Recipe", "Memory", "FeatureMap", "Objective", "Optimizer", "Retention", "RecipeError",
    "MemoryState", "MesaState", "KVCache", "ZOO", "UnknownModelError",
]
