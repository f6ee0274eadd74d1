"""ConfigError and the checks every config's __post_init__ runs: a bad value raises naming the field, the value
and what is allowed, so nothing wrong gets as far as a trace."""

from __future__ import annotations

import jax.numpy as jnp


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


def require(ok: bool, owner: str, field: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{owner}.{field} = {value!r} is invalid: allowed {allowed}")


DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
}


def dtype_from_name(name: str, field: str = "dtype"):
    """Maps a dtype name ('bfloat16', ...) to the jnp dtype; an unknown name is a ConfigError."""
    if name not in DTYPES:
        raise ConfigError(f"{field} = {name!r} is invalid: allowed {sorted(DTYPES)}")
    return DTYPES[name]


def require_positive_ints(config, *names: str) -> None:
    """Each named field of config is an integer >= 1."""
    for name in names:
        value = getattr(config, name)
        require(isinstance(value, int) and value >= 1, type(config).__name__, name, value, "an integer >= 1")


def require_dtype_names(config, *names: str) -> None:
    """Each named field of config is a dtype name of DTYPES."""
    for name in names:
        dtype_from_name(getattr(config, name), f"{type(config).__name__}.{name}")




def require_optional_positive_ints(config, *names: str) -> None:
    """Each named field of config is None or an integer >= 1."""
    for name in names:
        value = getattr(config, name)
        require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                type(config).__name__, name, value, "None or an integer >= 1")


def require_choice(config, name: str, options: tuple) -> None:
    """The named field of config is one of options (the message lists them: 'a', 'b' or 'c')."""
    value = getattr(config, name)
    words = ", ".join(map(repr, options[:-1])) + f" or {options[-1]!r}" if len(options) > 1 else repr(options[0])
    require(value in options, type(config).__name__, name, value, words)


def require_float(config, name: str, low: float, high: float | None = None, *, low_open: bool = False,
                  note: str = "") -> None:
    """The named field of config is a number above low (at least low unless low_open) and at most high."""
    value = getattr(config, name)
    ok = value > low if low_open else value >= low
    if high is None:
        allowed = f"a float {'>' if low_open else '>='} {low}"
    else:
        ok, allowed = ok and value <= high, f"a float in {'(' if low_open else '['}{low}, {high}]"
    require(ok, type(config).__name__, name, value, allowed + note)
