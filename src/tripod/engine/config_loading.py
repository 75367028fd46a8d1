"""Loading a config dataclass from YAML and `key=value` overrides with omegaconf, and writing it back.

Generic over the schema (engine/config/ passes `TripodConfig`), so this module imports nothing of tripod's: an
unknown key is reported with its closest valid key (or, for keys tripod has on purpose left out, a pointer to the
one to use), a bad value with its key and the expected type.
"""
from __future__ import annotations

import difflib
import os
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration problem; the message names every offending key and how to fix it."""


def _is_section(node: DictConfig) -> bool:
    """A dataclass section (its keys are the schema's) rather than a free-form dict field such as
    rollout.engine_kwargs, whose keys belong to another program."""
    return node._metadata.object_type not in (None, dict)


def _unknown_keys(schema: DictConfig, user: Any, moved: dict[str, str], prefix: str = "") -> list[str]:
    """Every key in `user` that the schema does not have, as a message with close matches."""
    problems = []
    if not isinstance(user, DictConfig):
        return problems
    for key in user.keys():
        full = f"{prefix}{key}"
        if full in moved:
            problems.append(f"{full}: not a tripod key; {moved[full]}")
        elif key not in schema:
            near = difflib.get_close_matches(str(key), [str(k) for k in schema.keys()], n=1)
            hint = f"did you mean '{prefix}{near[0]}'? " if near else ""
            problems.append(f"{full}: unknown key; {hint}valid keys under '{prefix.rstrip('.') or '<root>'}' "
                            f"are {sorted(str(k) for k in schema.keys())}")
        elif isinstance(schema._get_node(key), DictConfig) and _is_section(schema._get_node(key)):
            problems += _unknown_keys(schema[key], user._get_node(key), moved, f"{full}.")
    return problems


def _merge(base: DictConfig, layer: DictConfig, source: str, moved: dict[str, str]) -> DictConfig:
    problems = _unknown_keys(base, layer, moved)
    if problems:
        raise ConfigError(f"{source} has keys tripod does not know:\n  - " + "\n  - ".join(problems))
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        reason = str(e).splitlines()[0]
        raise ConfigError(f"{source}: bad value for {key}: {reason}; give {key} a value of the type in "
                          "engine/config/ (see recipes/defaults.yaml)") from None


def load_structured(schema: type, yaml_path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                    moved: dict[str, str] | None = None) -> Any:
    """Defaults of the dataclass `schema` <- YAML recipe <- `key=value` overrides, resolved into a `schema` instance.
    `moved` maps keys left out of the schema on purpose to a pointer at what to set instead.

    Raises ConfigError for an unknown key (with the closest valid key), a value of the wrong type, a malformed
    override, a missing YAML file or one that is not valid YAML.
    """
    cfg = OmegaConf.structured(schema)
    if yaml_path is not None:
        yaml_path = os.fspath(yaml_path)
        if not os.path.isfile(yaml_path):
            raise ConfigError(f"config file {yaml_path} does not exist; pass an existing YAML recipe (see recipes/)")
        try:
            loaded = OmegaConf.load(yaml_path)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"config file {yaml_path} is not valid YAML{where}: {problem}; fix the recipe "
                              "(see recipes/defaults.yaml)") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file {yaml_path} must hold a mapping of keys at the top level")
        cfg = _merge(cfg, loaded, f"config file {yaml_path}", moved or {})
    overrides = list(overrides or [])
    bad = [o for o in overrides if "=" not in o or o.startswith(("+", "~"))]
    if bad:
        raise ConfigError(f"overrides {bad} are not of the form key=value (e.g. data.train_batch_size=64); "
                          "tripod has no '+key'/'~key' syntax: every key already exists with a default")
    if overrides:
        cfg = _merge(cfg, OmegaConf.from_dotlist(overrides), f"command-line overrides {overrides}", moved or {})
    for key in ("data.train_files", "data.val_files"):  # a single path is a one-element list
        value = OmegaConf.select(cfg, key)
        if value is None:
            OmegaConf.update(cfg, key, [], merge=False)
        elif isinstance(value, str):
            OmegaConf.update(cfg, key, [value], merge=False)
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"cannot resolve {key}: {str(e).splitlines()[0]}") from None


def config_to_yaml(cfg: Any) -> str:
    """The fully resolved YAML of a config dataclass instance (or DictConfig)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg) if not isinstance(cfg, DictConfig) else cfg, resolve=True)


def config_to_dict(cfg: Any) -> dict:
    """The fully resolved config as plain nested dicts (a tracker's run config)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg) if not isinstance(cfg, DictConfig) else cfg, resolve=True)


def save_resolved_config(cfg: Any, run_dir: str | os.PathLike) -> str:
    """Write the fully resolved config to `run_dir/config.yaml` (load it back with `load_config`); returns the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(os.fspath(run_dir), "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(config_to_yaml(cfg))
    os.replace(tmp, path)
    return path
