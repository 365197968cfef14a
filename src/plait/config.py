"""Typed, strict configuration.

One dataclass per section; each field's docstring is the comment above it. A config is built from
defaults, then a TOML file, then ``--section.key=value`` overrides, and validated once. Unknown
sections or keys are errors that name the nearest valid one. The resolved config is written to the
run directory as TOML so that a run can be resumed or reproduced from it.

The sections themselves are declared in ``plait.config_sections`` (re-exported here). This module parses and
type-checks only and imports nothing else of plait. Checks that need the world
size, a layout's knowledge or the model live with them and are gathered in ``plait.validate``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from plait.config_sections import (  # noqa: F401 (re-exported: plait.config is where users import them)
    CheckpointConfig,
    CommConfig,
    Config,
    ConfigError,
    DataConfig,
    FaultConfig,
    LaunchConfig,
    ModelConfig,
    MoeConfig,
    ObserveConfig,
    OptimConfig,
    ParallelConfig,
    PsConfig,
    RunConfig,
    TrainConfig,
)


def _nearest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.0)
    return close[0] if close else choices[0]


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _parse_literal(text: str) -> Any:
    """A command-line value as TOML would read it (``64`` -> int, ``true`` -> bool, ``[1, 2]`` -> list,
    ``{a = 1}`` -> dict), else the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise a ConfigError."""
    where = f"{section}.{key}"
    origin = get_origin(typ)
    if origin is Literal:
        allowed = get_args(typ)
        if value not in allowed:
            raise ConfigError(f"{where} must be one of {', '.join(map(str, allowed))}; got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(section, key, value, typ)
    if origin is dict:
        if isinstance(value, str):
            value = _parse_literal(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table (in TOML: [{section}.{key}]); got {value!r}")
        _, value_type = get_args(typ)
        return {str(k): v if value_type is Any else _coerce(section, f"{key}.{k}", v, value_type)
                for k, v in value.items()}
    if origin is list:
        if isinstance(value, str):  # a TOML list ("[]", '["a", "b"]'), else comma-separated items (a,b or [a, b])
            parsed = _parse_literal(value) if value.strip().startswith("[") else value
            value = parsed if isinstance(parsed, list) else [
                v.strip().strip("'\"") for v in value.strip().removeprefix("[").removesuffix("]").split(",")
                if v.strip().strip("'\"")]
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list; got {value!r}")
        (item_type,) = get_args(typ)
        return [_coerce(section, key, v, item_type) for v in value]
    return _coerce_scalar(where, value, typ)


def _coerce_union(section: str, key: str, value: Any, typ: Any) -> Any:
    """The first type of ``typ``'s options the value fits, in the declared order (a table for a dict option)."""
    where = f"{section}.{key}"
    options = [a for a in get_args(typ) if a is not type(None)]
    if isinstance(value, str) and any(get_origin(a) is dict for a in options) and value.lstrip().startswith("{"):
        value = _parse_literal(value)
    if isinstance(value, dict):
        return _coerce(section, key, value, next(a for a in options if get_origin(a) is dict))
    errors = []
    for option in options:
        try:
            return _coerce(section, key, value, option)
        except ConfigError as e:
            errors.append(str(e).split("; got")[0].removeprefix(f"{where} must be "))
    raise ConfigError(f"{where} must be {' or '.join(errors)}; got {value!r}")


def _coerce_scalar(where: str, value: Any, typ: Any) -> Any:
    """A bool, int, float or str field's value."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be true or false; got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer; got {value!r}")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be an integer; got {value!r}") from None
        if as_float != int(as_float):
            raise ConfigError(f"{where} must be an integer; got {value!r}")
        return int(as_float)
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number; got {value!r}") from None
    if typ is str:
        if isinstance(value, dict | list):
            raise ConfigError(f"{where} must be a string; got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported type {typ}")


def _is_table(typ: Any) -> bool:
    return get_origin(typ) is dict or any(get_origin(a) is dict for a in get_args(typ))


# TOML keys that are not Python names: key -> field.
_ALIASES = {"checkpoint.async": "async_save"}
# Keys that were replaced: old key -> what to write instead.
_REPLACED = {"observe.tensorboard": 'observe.trackers (a list: ["tensorboard"] writes TensorBoard files, [] none)'}


def _set(cfg: Config, section: str, key: str, value: Any) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(
            f"unknown config section '{section}'; did you mean '{_nearest(section, list(sections))}'?"
        )
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    if f"{section}.{key}" in _REPLACED:
        raise ConfigError(f"config key '{section}.{key}' was replaced by {_REPLACED[f'{section}.{key}']}")
    key = _ALIASES.get(f"{section}.{key}", key)
    name, _, sub = key.partition(".")
    if sub and name in hints and _is_table(hints[name]):
        # --model.args.width=64: one entry of a table, its value read as TOML would read it
        table = dict(getattr(obj, name)) if isinstance(getattr(obj, name), dict) else {}
        table[sub] = _parse_literal(value) if isinstance(value, str) else value
        setattr(obj, name, _coerce(section, name, table, hints[name]))
        return
    if key not in hints:
        valid = [f"{section}.{k}" for k in hints]
        raise ConfigError(
            f"unknown config key '{section}.{key}'; did you mean '{_nearest(f'{section}.{key}', valid)}'?"
        )
    setattr(obj, key, _coerce(section, key, value, hints[key]))


def apply_mapping(cfg: Config, data: dict[str, Any]) -> None:
    """Apply a nested {section: {key: value}} mapping (parsed TOML) onto cfg, strictly."""
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"config entry '{section}' must be a [section] table; valid sections: "
                + ", ".join(_sections())
            )
        for key, value in values.items():
            _set(cfg, section, key, value)


def apply_overrides(cfg: Config, overrides: list[str]) -> None:
    """Apply ``section.key=value`` (or ``--section.key=value``) strings onto cfg."""
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override '{item}' must look like --section.key=value")
        dotted, value = text.split("=", 1)
        section, key = dotted.split(".", 1)
        _set(cfg, section, key, value)


def from_sections(sections: dict[str, Any], base: Config | None = None) -> Config:
    """A config from keyword sections, e.g. ``{"parallel": {"zero": 2}, "train": {"steps": 10}}``;
    a section may also be given as its dataclass (``ParallelConfig(zero=2)``)."""
    cfg = copy.deepcopy(base) if base is not None else Config()
    for name, value in sections.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if name not in _sections():
                _set(cfg, name, "", None)  # raises the unknown-section error
            if not isinstance(value, type(getattr(cfg, name))):
                raise ConfigError(f"section '{name}' must be a {type(getattr(cfg, name)).__name__} or a dict")
            setattr(cfg, name, copy.deepcopy(value))
        elif isinstance(value, dict):
            apply_mapping(cfg, {name: value})
        else:
            raise ConfigError(f"config section '{name}' must be a dict of keys or a section dataclass; got {value!r}")
    return cfg


Defaults = Callable[[Config], Mapping[str, Mapping[str, Any]]]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: Defaults | None = None) -> Config:
    """Defaults, then the TOML file at ``path``, then overrides; values type-checked.

    ``defaults(cfg)``, given the config the file and overrides make, returns ``{section: {key: value}}`` that
    replaces plait's own defaults for that config (a registered model's: ``plait.recipes.recipe_defaults``):
    a layer under the file and the overrides, so a key the user sets keeps the user's value."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass the path of a TOML file")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None

    def layered(base: Mapping[str, Mapping[str, Any]]) -> Config:
        cfg = Config()
        apply_mapping(cfg, {k: dict(v) for k, v in base.items()})
        apply_mapping(cfg, data)
        apply_overrides(cfg, overrides or [])
        return cfg

    cfg = layered({})
    below = defaults(cfg) if defaults is not None else {}
    return layered(below) if below else cfg


def _check_data(d: DataConfig) -> None:
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError("data.val_fraction must be between 0 and 1 (exclusive)")
    for name in ("num_workers", "tokenize_processes"):
        if getattr(d, name) < 0:
            raise ConfigError(f"data.{name} must be 0 or more; got {getattr(d, name)}")
    if d.shuffle_buffer < 1:
        raise ConfigError(f"data.shuffle_buffer must be at least 1 document; got {d.shuffle_buffer}")
    pack = d.pack if isinstance(d.pack, bool) else bool(d.tokenizer)
    if pack and not d.tokenizer:
        raise ConfigError("data.pack needs data.tokenizer (bytes have no end-of-document token); set data.tokenizer "
                          "or data.pack=false")
    if d.document_mask and not pack:
        raise ConfigError("data.document_mask needs packed documents: set data.tokenizer (and data.pack=true)")


def check_values(cfg: Config) -> Config:
    """Checks of single values and of keys within one section; nothing that needs the world size, the
    layout or the model (``plait.validate.validate`` adds those)."""
    m, t, p, c = cfg.model, cfg.train, cfg.parallel, cfg.comm
    if cfg.observe.count_torch_collectives not in ("first_step", "every_step", "off"):
        raise ConfigError(f"observe.count_torch_collectives={cfg.observe.count_torch_collectives!r}: choose "
                          "first_step, every_step or off")
    for name in ("n_layer", "d_model", "n_head", "seq_len"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} must be at least 1")
    if m.vocab_size < 0:
        raise ConfigError(f"model.vocab_size must be 0 (the tokenizer's) or more; got {m.vocab_size}")
    for name in ("steps", "global_batch_size"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name} must be at least 1")
    if t.micro_batch_size < 0:
        raise ConfigError(f"train.micro_batch_size must be at least 1, or 0 for the loader's batch size (else "
                          f"global_batch_size / dp); got {t.micro_batch_size}")
    if t.checkpoint_every_k < 1:
        raise ConfigError(f"train.checkpoint_every_k must be at least 1; got {t.checkpoint_every_k}")
    _check_data(cfg.data)
    o = cfg.observe
    if len(set(o.trackers)) != len(o.trackers):
        raise ConfigError(f"observe.trackers names a tracker twice: {o.trackers}")
    if not 0 <= o.prometheus_port <= 65535:
        raise ConfigError(f"observe.prometheus_port must be a TCP port (1-65535), or 0 for off; got "
                          f"{o.prometheus_port}")
    if p.bucket_mb <= 0:
        raise ConfigError("parallel.bucket_mb must be positive")
    if p.dp_replicate < 0:
        raise ConfigError(f"parallel.dp_replicate must be 0 (one replica group per rank) or the replica groups of "
                          f"fault.mode=replicas; got {p.dp_replicate}")
    if p.dp_shard < 0:
        raise ConfigError(f"parallel.dp_shard must be 0 (shard over every data-parallel rank) or the ranks per "
                          f"shard group; got {p.dp_shard}")
    if isinstance(p.tp_plan, str) and p.tp_plan != "auto":
        raise ConfigError(f"parallel.tp_plan must be auto or a table of module-name patterns to styles; got "
                          f"{p.tp_plan!r}")
    for ref, what in ((cfg.model.factory, "model.factory"), (cfg.data.factory, "data.factory")):
        if ref and (":" not in ref or not all(ref.split(":", 1))):
            raise ConfigError(f"{what}={ref!r} must look like package.module:function")
    if c.timeout_s <= 0:
        raise ConfigError(f"comm.timeout_s must be positive seconds; got {c.timeout_s}")
    if c.ranks_per_node < 0:
        raise ConfigError(f"comm.ranks_per_node must be >= 1, or 0 for LOCAL_WORLD_SIZE; got {c.ranks_per_node}")
    if c.compress in ("topk", "randomk") and not 0.0 < c.compress_ratio <= 1.0:
        raise ConfigError(f"comm.compress_ratio is the kept fraction, in (0, 1]; got {c.compress_ratio}")
    if c.compress in ("powersgd", "auto") and c.powersgd_rank < 1:
        raise ConfigError(f"comm.powersgd_rank must be at least 1; got {c.powersgd_rank}")
    f = cfg.fault
    for name in ("spike_jump", "skip_batches", "max_rollbacks"):
        if getattr(f, name) < 0:
            raise ConfigError(f"fault.{name} must be 0 or more; got {getattr(f, name)}")
    if f.spike_patience < 1 or f.spike_window < 4 or f.spike_warmup_steps < -1:
        raise ConfigError(f"fault.spike_patience must be at least 1 (got {f.spike_patience}), fault.spike_window at "
                          f"least 4 (got {f.spike_window}), fault.spike_warmup_steps -1 (auto) or more (got "
                          f"{f.spike_warmup_steps})")
    if c.stochastic_rounding and c.compress not in ("int8", "int4"):
        raise ConfigError(f"comm.stochastic_rounding applies to comm.compress=int8 or int4, not {c.compress}; "
                          "set comm.stochastic_rounding=false")
    return cfg


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_value(key)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, float) and v != v:
        return "nan"
    return repr(v)


def to_toml(cfg: Config) -> str:
    """Render the config as TOML: one table per section, its tables (``[model.args]``) after it."""
    lines: list[str] = []
    for f in dataclasses.fields(cfg):
        lines.append(f"[{f.name}]")
        tables = []
        for k, v in dataclasses.asdict(getattr(cfg, f.name)).items():
            if isinstance(v, dict):
                tables.append((k, v))
            else:
                lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
        for k, v in tables:
            lines.append(f"[{f.name}.{k}]")
            lines.extend(f"{_toml_key(str(a))} = {_toml_value(b)}" for a, b in v.items())
            lines.append("")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def field_docs(section_type: type) -> dict[str, str]:
    """Each field's documentation: the comment lines right above it in this file."""
    import inspect

    docs: dict[str, str] = {}
    comment: list[str] = []
    for line in inspect.getsource(section_type).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            comment.append(text.lstrip("#").strip())
        elif (m := re.match(r"^([a-z_][a-z0-9_]*)\s*:", text)) is not None:
            docs[m.group(1)] = " ".join(comment)
            comment = []
        else:
            comment = []
    return docs


def describe_keys(other_defaults: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """Every config key with its type, default and documentation, section by section (for --help);
    ``other_defaults`` maps a dotted key to ``{who: value}`` for defaults that differ by recipe
    (``plait.recipes.defaults_by_key``), shown after plait's own."""
    import textwrap

    out: list[str] = []
    defaults = Config()
    other_defaults = other_defaults or {}
    for name, section_type in _sections().items():
        out.append(f"[{name}]")
        docs = field_docs(section_type)
        hints = typing.get_type_hints(section_type)
        for f in dataclasses.fields(section_type):
            default = getattr(getattr(defaults, name), f.name)
            typ = hints[f.name]
            kind = " | ".join(map(str, get_args(typ))) if get_origin(typ) is Literal else _type_name(typ)
            others = other_defaults.get(f"{name}.{f.name}", {})
            shown = "".join(f"; {who}: {_toml_value(v)}" for who, v in others.items())
            out.append(f"  {name}.{f.name} = {_toml_value(default)}{shown}   ({kind})")
            out.extend(textwrap.wrap(docs.get(f.name, ""), width=96, initial_indent="      ",
                                     subsequent_indent="      "))
        out.append("")
    return "\n".join(out)


def _type_name(typ: Any) -> str:
    if get_origin(typ) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(typ))
    if get_origin(typ) is dict:
        return "table"
    if get_origin(typ) is list:
        return "list"
    return getattr(typ, "__name__", str(typ))
