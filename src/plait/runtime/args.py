"""Splitting a command line: a CONFIG path, ``--option VALUE`` flags and ``--section.key=value`` overrides
(``plait train``, ``run``, ``simulate``, ``plan``, ``calibrate`` all read theirs this way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plait.config import ConfigError


def split_args(argv: list[str], options: dict[str, Callable[[str], Any] | None] | None = None,
               choices: dict[str, tuple[str, ...]] | None = None,
               metavars: dict[str, str] | None = None) -> tuple[str | None, dict[str, Any], list[str]]:
    """(CONFIG path or None, option values, ``--section.key=value`` overrides) of a command line.

    ``options``: option name -> converter of its value (``--name VALUE`` or ``--name=VALUE``), or None for a
    switch; ``choices`` restrict values; unknown options, a second CONFIG, a missing value are errors."""
    options, choices, metavars = options or {}, choices or {}, metavars or {}
    config, values, overrides = None, {}, []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in options and options[name] is None:
            values[name] = True
        elif name in options:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value: {name} {metavars.get(name, 'VALUE')}")
                value, i = argv[i + 1], i + 1
            try:
                values[name] = options[name](value)  # type: ignore[misc]
            except ValueError:
                raise ConfigError(f"{name} needs a whole number; got {value!r}") from None
            if name in choices and value not in choices[name]:
                raise ConfigError(f"{name} must be one of {', '.join(choices[name])}; got {value!r}")
        elif a.startswith("--") and "." in name:
            if eq:
                overrides.append(a)
            elif i + 1 < len(argv):
                overrides.append(f"{a}={argv[i + 1]}")
                i += 1
            else:
                raise ConfigError(f"{a} needs a value: {a}=VALUE")
        elif a.startswith("-"):
            known = ", ".join(f"{n} {metavars[n]}" if n in metavars else n for n in options)
            raise ConfigError(f"unknown option {a}; options are {known + ' and ' if known else ''}--section.key=value")
        elif config is None:
            config = a
        else:
            raise ConfigError(f"unexpected argument {a!r}; pass at most one CONFIG.toml")
        i += 1
    return config, values, overrides
