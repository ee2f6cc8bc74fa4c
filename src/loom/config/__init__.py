"""Configuration (layer 0), by what each part is:

- `schema.py` the dataclass tree: one dataclass per section, a docstring, default and bounds per field.
- `io.py` reading and writing it: defaults -> TOML file -> `--section.key=value` overrides, model.family's
  presets, TOML out, a checkpoint's dict back into a Config, `--help-config`.
- `layout.py` what a config resolves to on a world: `ParallelDims` (the layout) and `Derived` (the batch).
- `validate.py` the one `validate(cfg, world)`, every rule once, and the check of a saved config against a run's.

The names the rest of loom uses are re-exported here: `from loom.config import Config, load_config, validate`.
"""

from loom.config.io import (
    FAMILIES,
    apply_dict,
    apply_family,
    check_choice,
    config_argv,
    config_from_dict,
    diff_configs,
    explicit_keys,
    help_text,
    load_config,
    load_toml,
    parse_overrides,
    read_config,
    set_key,
    to_toml,
)
from loom.config.layout import SHARDED, WRAPPERS, Derived, ParallelDims
from loom.config.schema import (
    CHOICES,
    FAMILY_SECTIONS,
    LIST_KEYS,
    PP_SCHEDULES,
    SCHEDULE_STAGES_PER_RANK,
    Config,
    DataConfig,
    EvalConfig,
    FamilySection,
    FinetuneConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
    all_keys,
    family_key,
)
from loom.config.validate import check_model_config, check_saved_config, check_tp_heads, validate

__all__ = [
    "CHOICES",
    "FAMILIES",
    "FAMILY_SECTIONS",
    "LIST_KEYS",
    "PP_SCHEDULES",
    "SCHEDULE_STAGES_PER_RANK",
    "SHARDED",
    "WRAPPERS",
    "Config",
    "DataConfig",
    "Derived",
    "EvalConfig",
    "FamilySection",
    "FinetuneConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ParallelDims",
    "PrecisionConfig",
    "RunConfig",
    "TrainConfig",
    "all_keys",
    "apply_dict",
    "apply_family",
    "check_choice",
    "check_model_config",
    "check_saved_config",
    "check_tp_heads",
    "config_argv",
    "config_from_dict",
    "diff_configs",
    "explicit_keys",
    "family_key",
    "help_text",
    "load_config",
    "load_toml",
    "parse_overrides",
    "read_config",
    "set_key",
    "to_toml",
    "validate",
]
