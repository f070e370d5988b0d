"""Typed configuration: dataclasses (defaults live only there), YAML files, dotted CLI overrides."""

from rlhf.config.loader import apply_overrides, from_dict, load_config, save_config, to_dict
from rlhf.config.schema import RlhfConfig

__all__ = ["RlhfConfig", "apply_overrides", "from_dict", "load_config", "save_config", "to_dict"]
