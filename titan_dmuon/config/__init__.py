"""Job configuration: dataclasses (job_config), TOML + CLI parsing and validation (manager)."""

from titan_dmuon.config.job_config import (
    ActivationCheckpoint,
    Compile,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)
from titan_dmuon.config.manager import (
    ConfigError,
    ConfigManager,
    config_from_dict,
    load_toml,
    parse_args,
    parse_args_or_exit,
    validate_config,
    validate_parallelism,
)

__all__ = [
    "ActivationCheckpoint",
    "Compile",
    "ConfigError",
    "ConfigManager",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "Validation",
    "config_from_dict",
    "load_toml",
    "parse_args",
    "parse_args_or_exit",
    "validate_config",
    "validate_parallelism",
]
