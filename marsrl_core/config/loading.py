"""Loading a config: a preset, then a YAML file, then `dotted.key=value` overrides, validated as one.

Invalid values raise `ConfigError`, whose message names the dotted field and the offending value.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from marsrl_core.config.presets import PRESETS
from marsrl_core.config.sections import ConfigError, MarsRLConfig


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted.key=value, e.g. rollout.segment_tokens=1024")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        field = ".".join(str(part) for part in item["loc"]) or "config"
        value = item.get("input")
        shown = "" if isinstance(value, dict) else f"={value!r}"
        lines.append(f"{field}{shown}: {item['msg'].removeprefix('Value error, ')}")
    return "invalid config: " + "; ".join(lines)


def migrate_renamed(data: dict[str, Any]) -> dict[str, Any]:
    """A stored run's config with renamed fields under their new names (a run recorded before a rename
    still resumes); a config a user gives keeps its old names, which are errors naming the new ones."""
    data = copy.deepcopy(data)
    for name, field in MarsRLConfig.model_fields.items():
        section = data.get(name)
        renamed = getattr(field.annotation, "RENAMED", {})
        if isinstance(section, dict):
            for old, new in renamed.items():
                if old in section:
                    section.setdefault(new, section.pop(old))
                    section.pop(old, None)
    return data


def build_config(data: dict[str, Any]) -> MarsRLConfig:
    """Validate a plain dict into a config, raising ConfigError that names field and value."""
    try:
        return MarsRLConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(
    preset: str = "tiny", yaml_path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> MarsRLConfig:
    """Preset, then YAML file, then `a.b=c` overrides, validated as one config."""
    if preset not in PRESETS:
        raise ConfigError(f"preset={preset!r}: unknown preset; choose one of {sorted(PRESETS)}")
    data = copy.deepcopy(PRESETS[preset])
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r}: no such file")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file {str(path)!r}: not valid YAML ({err})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r}: top level must be a mapping, got {type(loaded).__name__}")
        data = _deep_merge(data, loaded)
    for text in overrides:
        keys, value = _parse_override(text)
        _set_dotted(data, keys, value, text)
    return build_config(data)


def _set_dotted(data: dict[str, Any], keys: list[str], value: Any, shown: str) -> None:
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {shown!r}: {key!r} is not a section")
    node[keys[-1]] = value


def with_overrides(config: MarsRLConfig, overrides: dict[str, Any] | None) -> MarsRLConfig:
    """`config` with a few fields changed, given as dotted keys (`{"learner.max_steps": 3}`), merged field
    by field and validated as one: how a deployment run from the UI, the API or `prefect deployment run
    --params` changes a few settings of the deployment's config instead of replacing all of it."""
    if not overrides:
        return config
    data = config.model_dump(mode="json")
    for key, value in overrides.items():
        _set_dotted(data, key.split("."), value, f"{key}={value!r}")
    return build_config(data)


def given_in_part(config: MarsRLConfig) -> bool:
    """Whether `config` was built from only some of its fields (the rest are the class defaults), as a
    flow's `config` parameter is when a run from the API gives `{"config": {"learner": {...}}}`."""
    return config.model_dump(mode="json", exclude_unset=True) != config.model_dump(mode="json")


def merged_over(base: dict[str, Any], config: MarsRLConfig) -> MarsRLConfig:
    """The fields `config` was given (pydantic's `exclude_unset`, not its defaults) merged field by field
    over `base`, a whole config as a dict, and validated as one."""
    return build_config(_deep_merge(base, config.model_dump(mode="json", exclude_unset=True)))


def default_config() -> MarsRLConfig:
    """The config a flow runs with when none is given: preset `MARSRL_PRESET` (default tiny) merged with
    the YAML file `MARSRL_CONFIG` when set (how a worker in docker-compose.yml gets its cluster settings)."""
    return load_config(os.environ.get("MARSRL_PRESET", "tiny"), os.environ.get("MARSRL_CONFIG") or None)


def config_to_yaml(config: MarsRLConfig) -> str:
    """The config as YAML, loadable again with `load_config(yaml_path=...)`."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def absolute_paths(config: MarsRLConfig) -> MarsRLConfig:
    """`config` with every local path resolved against the current folder: the output folder (and so
    the checkpoint URIs a run records), a SQLite store and its data folder, a SQLite MLflow database,
    the model and the datasets. A run records its config so; resumed from another folder it still
    finds its checkpoints and files. Remote locations (postgres:, s3://, http://) stay as they are."""

    def local(path: str | None) -> str | None:
        return path if path is None or "://" in path else str(Path(path).resolve())

    store, tracking = config.store, config.tracking
    catalog = store.catalog_url
    if catalog.startswith("sqlite:"):
        catalog = "sqlite:" + local(catalog.removeprefix("sqlite:"))
    uri = tracking.mlflow_tracking_uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + local(uri.removeprefix("sqlite:///"))
    return config.model_copy(
        update={
            "output_dir": local(config.output_dir),
            "store": store.model_copy(update={"catalog_url": catalog, "data_path": local(store.data_path)}),
            "tracking": tracking.model_copy(update={"mlflow_tracking_uri": uri}),
            "model": config.model.model_copy(update={"path": local(config.model.path)}),
            "data": config.data.model_copy(update={"train_dataset": local(config.data.train_dataset)}),
            "evaluation": config.evaluation.model_copy(update={"dataset": local(config.evaluation.dataset)}),
        }
    )
