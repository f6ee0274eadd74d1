"""Configs from YAML files and `--set key.sub=value` overrides, coerced strictly into the frozen dataclasses."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

from specjax.config._checks import ConfigError


def from_dict(cls, data: dict, where: str):
    """Builds the (possibly nested) frozen dataclass cls from a mapping, strictly: an unknown key, a
    missing required key or a value of the wrong type is a ConfigError naming the key, `where` (the
    file) and what is allowed."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} in {cls.__name__}: allowed {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        values[name] = _convert(hints[name], value, f"{where}: {cls.__name__}.{name}")
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: {cls.__name__} is missing required key {missing[0]!r}")
    try:
        return cls(**values)
    except ConfigError as error:  # the class's own checks: say which file
        raise ConfigError(f"{where}: {error}") from error


def _convert(hint, value, where: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where.split(":")[0])
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r} is invalid: allowed a list")
        item = args[0] if args else typing.Any
        return tuple(_convert(item, v, where) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} = {value!r} is invalid: allowed a mapping")
        return {_convert(args[0], k, where): _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r} is invalid: allowed a list")
        return [_convert(args[0], v, where) for v in value] if args else list(value)
    if hint is typing.Any:
        return value
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where} = {value!r} is invalid: allowed one of {list(args)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} = {value!r} is invalid: allowed a number")
        return float(value)
    if hint in (int, str, bool) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        kind = {int: "an integer", str: "a string", bool: "true or false"}[hint]
        raise ConfigError(f"{where} = {value!r} is invalid: allowed {kind}")
    return value


def load_yaml(cls, path, overrides=()):
    """A config from a YAML file with `key.sub=value` overrides (values parsed as YAML; the command line's
    --set). Malformed YAML and keys no field has are one-line ConfigErrors naming the file or the --set."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    data = parse_yaml(path.read_text(), str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of {cls.__name__}'s fields, got {type(data).__name__}")
    data = with_overrides(cls, data, overrides)
    return from_dict(cls, data, str(path) + (f" with --set {' '.join(overrides)}" if overrides else ""))


def with_overrides(cls, data: dict, overrides=()) -> dict:
    """data (a mapping of cls's fields, changed in place) with `key.sub=value` overrides (values parsed as
    YAML; the command line's --set); a key no field of cls has is a ConfigError naming the --set."""
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep:
            raise ConfigError(f"--set {override!r} is invalid: allowed key=value (e.g. optimizer.lr=3e-4)")
        check_field_path(cls, key, f"--set {override}")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):  # absent or null: the override starts the mapping
                node[part] = {}
            node = node[part]
        node[leaf] = parse_yaml(raw, f"--set {override}")
    return data


def parse_yaml(text: str, where: str):
    """YAML text parsed; a syntax error is a ConfigError naming where, the line and column and the problem."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = ": ".join(filter(None, (getattr(error, "context", None), getattr(error, "problem", None))))
        raise ConfigError(f"{where}: malformed YAML{at}: {problem or error}") from None


def check_field_path(cls, key: str, where: str) -> None:
    """A ConfigError naming `where` unless the dotted key names a field of cls's (nested) dataclasses; below
    a field that is no dataclass (e.g. a sweep's grid mapping) any key goes."""
    node = cls
    for depth, part in enumerate(key.split(".")):
        if not dataclasses.is_dataclass(node):
            return
        fields = {f.name for f in dataclasses.fields(node)}
        if part not in fields:
            inside = ".".join(key.split(".")[:depth])
            raise ConfigError(f"{where}: unknown key {part!r}{f' in {inside}' if inside else ''} "
                              f"({node.__name__}): allowed {sorted(fields)}")
        hint = typing.get_type_hints(node)[part]
        options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        node = next((a for a in options if dataclasses.is_dataclass(a)), options[0])

