"""Reading and writing a config (layer 0): `--section.key=value` overrides and TOML files (defaults -> TOML ->
overrides, then model.family's preset for the model keys neither set), unknown sections or keys refused with
the closest valid key, values of the wrong type refused too; TOML out (`to_toml`), the dict a checkpoint
records back into a Config (`config_from_dict`), and the text of `loom train --help-config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from loom.config.schema import (
    CHOICES,
    FAMILY_SECTIONS,
    LIST_KEYS,
    Config,
    ModelConfig,
    all_keys,
    section_types,
)
from loom.errors import LoomError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(options)}"


def _coerce(key: str, value: Any, default: Any, from_text: bool) -> Any:
    """Check (TOML) or parse (command line) a value against the type of the field's default."""
    kind = type(default)
    if from_text:
        text = str(value)
        try:
            if kind is bool:
                low = text.lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return low in ("true", "1", "yes")
            if kind is int:
                return int(text.replace("_", ""))
            if kind is float:
                return float(text)
            return text
        except ValueError:
            raise LoomError(
                f"config key '{key}' expects {kind.__name__}, got '{text}'",
                hint=f"for example --{key}={default}",
            ) from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (
        kind is str
        and key in LIST_KEYS
        and isinstance(value, list)
        and all(isinstance(v, str) for v in value)
    ):
        return ",".join(value)  # a TOML list of names, kept as the comma list the command line gives
    if type(value) is not kind:
        raise LoomError(
            f"config key '{key}' expects {kind.__name__}, got {type(value).__name__} ({value!r})",
            hint=f"for example {key.split('.')[-1]} = {default!r}".replace("'", '"'),
        )
    return value


def set_key(cfg: Config, key: str, value: Any, from_text: bool = False) -> None:
    """Set `section.key` on cfg, with the unknown-key and type checks."""
    if "." not in key:
        raise LoomError(f"config key '{key}' needs a section", hint=_suggest(key, all_keys()))
    section, name = key.split(".", 1)
    if section not in section_types():
        raise LoomError(f"unknown config section '{section}'", hint=_suggest(section, list(section_types())))
    sub = getattr(cfg, section)
    names = [f.name for f in fields(sub)]
    if section == "model" and name not in names:
        _set_family_key(cfg.model, name, value, from_text)
        return
    if name not in names:
        raise LoomError(
            f"unknown config key '{key}'", hint=_suggest(key, [f"{section}.{n}" for n in names] + all_keys())
        )
    value = _coerce(key, value, getattr(sub, name), from_text)
    check_choice(key, value)
    setattr(sub, name, value)


def _family_keys() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every registered family's own keys: name -> (its family, its field)."""
    return {
        f.name: (family, f)
        for family, section in FAMILY_SECTIONS.items()
        if section.keys is not None
        for f in fields(section.keys)
    }


def _set_family_key(m: ModelConfig, name: str, value: Any, from_text: bool) -> None:
    """model.<name>, a family's own key: set on the model's family_keys when its family has it; else kept
    until apply_family knows the family (a TOML's keys come in any order, model.family among them)."""
    own = m.__dict__.get("family_keys")
    if own is not None and name in own.__dataclass_fields__:
        setattr(own, name, _coerce(f"model.{name}", value, getattr(own, name), from_text))
        return
    known = _family_keys()
    if name not in known:
        hint = _suggest(f"model.{name}", [f"model.{n}" for n in known] + all_keys())
        if not hint and not FAMILY_SECTIONS:  # no family registered yet: nothing to compare with
            hint = "a family's own keys are known once loom.model (or the plug-in) has registered it"
        raise LoomError(f"unknown config key 'model.{name}'", hint=hint)
    m.__dict__.setdefault("pending", {})[name] = (value, from_text)


def check_choice(key: str, value: Any) -> None:
    """A key with a fixed set of values (CHOICES; model.family: the registered families, plug-ins too) holds
    one of them: the one check, made by set_key and by code handed such a value directly (FSDP's mp_policy)."""
    section, name = key.split(".", 1)
    choices = tuple(FAMILIES) if key == "model.family" else CHOICES.get((section, name))
    if choices and value not in choices:
        hint = "a plug-in family is loaded by naming its module in LOOM_PLUGINS" if name == "family" else None
        shown = ", ".join(c or '""' for c in choices)  # '""': the empty value (param_dtype's default)
        raise LoomError(f"config key '{key}' must be one of {shown}; got '{value}'", hint=hint)


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"  # a folder, /dev/zero, a FIFO
        raise LoomError(f"config file '{p}' {what}", hint="give the path of a .toml file")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise LoomError(f"config file '{p}' is not valid TOML: {e}") from None
    except OSError as e:
        raise LoomError(f"cannot read config file '{p}': {e.strerror or e}") from None


def apply_dict(cfg: Config, data: dict[str, Any]) -> None:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise LoomError(
                f"config entry '{section}' must be a [section] table",
                hint=_suggest(section, list(section_types())),
            )
        for name, value in values.items():
            set_key(cfg, f"{section}.{name}", value)


def explicit_keys(config_path: str | None, overrides: list[str]) -> set[str]:
    """The keys a user set ("section.key"), in the config file or as --section.key=value overrides: they win
    over what a resumed run or model.init_from would set, and a conflict with those is an error."""
    keys = {k for k, _ in parse_overrides(overrides)}
    if config_path:
        keys |= {f"{s}.{k}" for s, kv in load_toml(config_path).items() for k in kv}
    return keys


def config_argv(argv: list[str], config_arg: str | None, rest: list[str]) -> tuple[str | None, list[str]]:
    """(config file, overrides) of a command with an optional config-file positional and --section.key=value
    overrides (`rest`: what argparse left): an override argparse took for the file goes back to the
    overrides, and `--train.steps 5` (no '=': the 5 read as the file) is refused, naming the fix."""
    rest = list(rest)
    if config_arg and config_arg.startswith("--"):
        return None, [config_arg, *rest]
    for i, a in enumerate(argv[1:], 1):
        prev = argv[i - 1]
        if config_arg and a == config_arg and prev.startswith("--") and "." in prev and "=" not in prev:
            raise LoomError(
                f"'{a}' after {prev} was taken for the config file: an override before the "
                f"config file needs '=' ({prev}={a})",
                hint=f"write {prev}={a}",
            )
    return config_arg, rest


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ['--model.n_layer=4', '--train.steps', '10'] into [(key, text)] pairs."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=")[0]:
            raise LoomError(
                f"unrecognised argument '{a}'", hint="config overrides look like --section.key=value"
            )
        if "=" in a:
            k, v = a[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise LoomError(f"override '{a}' has no value", hint=f"write {a}=VALUE")
            k, v = a[2:], args[i + 1]
            i += 1
        out.append((k, v))
        i += 1
    return out


# model.family presets: the model keys each family sets, unless the TOML or the command line sets them. Every
# family's comes from its registration (loom.model.registry.register, a plug-in's too), with its own keys
# (FAMILY_SECTIONS): the config layer never imports the model package. The default family's preset is the
# defaults, so a config of it parses before any family is registered.
FAMILIES: dict[str, dict[str, Any]] = {}


def apply_family(cfg: Config, explicit: set[str]) -> None:
    """Set model.family's preset keys, except those in `explicit` ('model.pos', ...: set by the user), after
    giving the model section its family's own keys (their defaults, then the values a TOML or an override
    set). A key of another family is refused unless it holds that key's default (the config.toml of a run
    saved before families owned their keys has every family's)."""
    m = cfg.model
    section = FAMILY_SECTIONS.get(m.family)
    if section is None and m.family != Config().model.family:
        raise LoomError(
            f"model.family={m.family} is not a registered family ({', '.join(FAMILIES) or 'none loaded'})",
            hint="import loom.model first (loom's commands do: it registers the built-in families); a plug-in "
            "family is loaded by naming its module in LOOM_PLUGINS",
        )
    m.family = m.family  # its own keys (ModelConfig.__setattr__), had the family registered after it was set
    for k, v in FAMILIES.get(m.family, {}).items():
        if f"model.{k}" not in explicit:
            setattr(m, k, v)
    for name, (value, from_text) in m.__dict__.pop("pending", {}).items():
        _pending_key(m, name, value, from_text)


def _pending_key(m: ModelConfig, name: str, value: Any, from_text: bool) -> None:
    own = m.__dict__.get("family_keys")
    if own is not None and name in own.__dataclass_fields__:
        setattr(own, name, _coerce(f"model.{name}", value, getattr(own, name), from_text))
        return
    family, f = _family_keys()[name]
    if _coerce(f"model.{name}", value, f.default, from_text) != f.default:
        raise LoomError(
            f"model.{name} is for model.family={family}; the family is '{m.family}'",
            hint=f"set model.family={family}, or leave model.{name} unset",
        )


def _keys(data: dict[str, Any]) -> set[str]:
    return {f"{s}.{k}" for s, values in data.items() if isinstance(values, dict) for k in values}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """defaults -> TOML file -> overrides (then model.family's preset for the model keys neither set)."""
    cfg = Config()
    data = load_toml(path) if path else {}
    apply_dict(cfg, data)
    pairs = parse_overrides(overrides or [])
    for k, v in pairs:
        set_key(cfg, k, v, from_text=True)
    explicit = _keys(data) | {k for k, _ in pairs}
    apply_family(cfg, explicit)
    if "model.activation" in explicit and cfg.model.mlp == "swiglu":  # set, and nothing reads it
        from loom import log

        log.warn(
            f"model.activation={cfg.model.activation} is not used: model.mlp=swiglu gates with SiLU "
            "(model.activation is the gelu MLP's); leave it out, or set model.mlp=gelu to use it"
        )
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    apply_dict(cfg, data)
    apply_family(cfg, _keys(data))
    return cfg


def read_config(path: str | Path) -> Config:
    """A config saved as TOML (a run's config.toml) as a Config: the file read and its keys applied in one
    answer, for the callers that ask both of a saved run."""
    return config_from_dict(load_toml(path))


def _toml_string(s: str) -> str:
    """A TOML basic string: quote and backslash escaped, and the control characters TOML forbids raw
    (U+0000-U+001F but tab, U+007F) as \\uXXXX, so a name with a newline still reads back."""
    out = []
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif (ord(c) < 0x20 and c != "\t") or c == "\x7f":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def to_toml(cfg: Config) -> str:
    """Write the resolved config as TOML (flat sections of scalars, so a tiny writer suffices)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if isinstance(v, bool):
                text = "true" if v else "false"
            elif isinstance(v, (int, float)):
                text = repr(v)
            else:
                text = _toml_string(str(v))
            lines.append(f"{k} = {text}")
        lines.append("")
    return "\n".join(lines)


def diff_configs(a: Config, b: Config, sections: tuple[str, ...] | None = None) -> list[str]:
    """Keys whose values differ, as 'key: a -> b'."""
    da, db = a.to_dict(), b.to_dict()
    out = []
    for s in da:
        if sections and s not in sections:
            continue
        for k in [*da[s], *(k for k in db[s] if k not in da[s])]:  # a family's own keys: in one of them only
            if da[s].get(k) != db[s].get(k):
                out.append(f"{s}.{k}: {da[s].get(k)!r} -> {db[s].get(k)!r}")
    return out


def help_text() -> str:
    cfg = Config()
    rows = []
    for s in section_types():
        rows.append(f"[{s}]")
        for f in fields(getattr(cfg, s)):
            d = getattr(getattr(cfg, s), f.name)
            rows.append(f"  {s}.{f.name} = {d!r}\n      {f.metadata.get('doc', '')}")
    for family, section in FAMILY_SECTIONS.items():  # each family's own keys, under it
        if section.keys is not None:
            rows.append(f"[model] keys of model.family={family}")
            for f in fields(section.keys):
                rows.append(f"  model.{f.name} = {f.default!r}\n      {f.metadata.get('doc', '')}")
    return "\n".join(rows)
