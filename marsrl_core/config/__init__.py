"""Configuration: pydantic models for every knob of a MarsRL run, and the presets.

One `MarsRLConfig` describes a whole run (model, engine, rollout, learner, store, tracking). It is
loaded from a preset (`tiny` for the CPU demo, `paper` for the MarsRL paper's settings), optionally
merged with a YAML file, then with `dotted.key=value` overrides from the command line. Every field
carries a description so that a Prefect form or `--help` can show it.

Deliberate simplification: one config type for all flows; flows read only the sections they need.
Invalid values raise `ConfigError`, whose message names the dotted field and the offending value.
"""

from marsrl_core.config.loading import (
    absolute_paths,
    build_config,
    config_to_yaml,
    default_config,
    given_in_part,
    load_config,
    merged_over,
    migrate_renamed,
    with_overrides,
)
from marsrl_core.config.presets import PRESETS
from marsrl_core.config.sections import (
    AGENTS,
    ConfigError,
    DataConfig,
    EngineConfig,
    EvaluationConfig,
    LearnerConfig,
    MarsRLConfig,
    ModelConfig,
    OutcomeConfig,
    RolesConfig,
    RolloutConfig,
    SFTConfig,
    StoreConfig,
    TrackingConfig,
)

__all__ = [
    "AGENTS",
    "PRESETS",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "EvaluationConfig",
    "LearnerConfig",
    "MarsRLConfig",
    "ModelConfig",
    "OutcomeConfig",
    "RolesConfig",
    "RolloutConfig",
    "SFTConfig",
    "StoreConfig",
    "TrackingConfig",
    "absolute_paths",
    "build_config",
    "config_to_yaml",
    "default_config",
    "given_in_part",
    "merged_over",
    "migrate_renamed",
    "load_config",
    "with_overrides",
]
