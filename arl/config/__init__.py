"""The arl configuration: the tree of sections, dotted overrides, backend strings, validation and
YAML round trips, one module each; everything a caller needs is importable from here.

A recipe builds a `Config` (`tree`); `python -m arl.launch RECIPE key.sub=value ...` applies
overrides with `apply_overrides` (`overrides`), checks the result with `Config.validate`
(`validate`) and saves it with `save_resolved` (`files`, which also prints ``--help``). Engine
placement is written as backend strings, `parse_backend` (`backend`).
"""

from arl.config.backend import TRAIN_ENGINES, Backend, engine_names, parse_backend
from arl.config.errors import ConfigError
from arl.config.files import converter, from_yaml, help_text, load_yaml, save_resolved, to_yaml
from arl.config.overrides import apply_overrides, convert_value
from arl.config.rules import import_problem
from arl.config.tree import (
    ActorConfig,
    ClusterConfig,
    Config,
    DataConfig,
    EvaluatorConfig,
    ExperimentConfig,
    GenerationConfig,
    LoraConfig,
    MiB,
    Norm,
    RecoverConfig,
    RefConfig,
    RolloutConfig,
    SaverConfig,
    StatsConfig,
    TransportConfig,
    WeightSyncConfig,
    field_keys,
    get_key,
)
from arl.config.validate import type_problems, validation_problems

__all__ = [
    "TRAIN_ENGINES",
    "ActorConfig",
    "LoraConfig",
    "Backend",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvaluatorConfig",
    "ExperimentConfig",
    "GenerationConfig",
    "MiB",
    "Norm",
    "RecoverConfig",
    "RefConfig",
    "RolloutConfig",
    "SaverConfig",
    "StatsConfig",
    "TransportConfig",
    "WeightSyncConfig",
    "apply_overrides",
    "convert_value",
    "converter",
    "field_keys",
    "from_yaml",
    "engine_names",
    "get_key",
    "help_text",
    "import_problem",
    "load_yaml",
    "parse_backend",
    "save_resolved",
    "to_yaml",
    "type_problems",
    "validation_problems",
]
