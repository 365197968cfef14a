"""Block YAML for the Kubernetes manifests: nested dicts, lists and scalars, the config file as a literal block.
Written here rather than with PyYAML so that ``plait launch`` needs no package beyond plait's own."""

from __future__ import annotations

import json
import re
from typing import Any

_PLAIN = re.compile(r"^[A-Za-z/][A-Za-z0-9_./-]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}  # read as booleans or null unquoted


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    text = str(v)
    if _PLAIN.match(text) and text.lower() not in _YAML_WORDS:
        return text
    return json.dumps(text)  # a JSON string is a valid YAML double-quoted scalar


def to_yaml(obj: dict[str, Any] | list[Any], indent: int = 0) -> str:
    """Block YAML for nested dicts, lists and scalars; multi-line strings (the config file) as literal blocks."""
    pad = " " * indent
    if isinstance(obj, dict):
        return "\n".join(_yaml_entry(f"{pad}{key}:", value, indent) for key, value in obj.items())
    lines = []
    for value in obj:
        if isinstance(value, dict) and value:  # a mapping in a list starts on the dash's line
            lines.append(f"{pad}- " + to_yaml(value, indent + 2)[indent + 2:])
        else:
            lines.append(_yaml_entry(f"{pad}-", value, indent))
    return "\n".join(lines)


def _yaml_entry(lead: str, value: Any, indent: int) -> str:
    if isinstance(value, str) and "\n" in value:
        body = "\n".join(" " * (indent + 2) + line if line else "" for line in value.rstrip("\n").split("\n"))
        return f"{lead} |\n{body}"
    if isinstance(value, dict | list):
        empty = "{}" if isinstance(value, dict) else "[]"
        return f"{lead}\n{to_yaml(value, indent + 2)}" if value else f"{lead} {empty}"
    return f"{lead} {_yaml_scalar(value)}"
