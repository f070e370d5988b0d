"""Typed configuration: dataclasses (defaults live only there), YAML files, dotted CLI overrides, the reference page.

The root schema (`RlhfConfig`) lives on the orchestration floor (`rlhf.orchestration.schema`), above its sections."""

from rlhf.config.loader import apply_overrides, from_dict, load_config, save_config, to_dict

__all__ = ["apply_overrides", "from_dict", "load_config", "save_config", "to_dict"]
