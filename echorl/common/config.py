"""Typed configuration for every role, and the command line built from it.

Each role (learner, node, train-local, demo) has one pydantic model whose fields carry their
type, bounds, default and (attribute) docstring. :func:`add_arguments` turns that model into the
role's flags: field ``foo_bar`` → ``--foo-bar`` (or the name declared with :class:`Flag` next to
the field), help from the docstring with the default shown, ``bool`` → ``--x/--no-x``, a
``Literal`` → choices, a list → a repeatable flag, a dict → a repeatable ``KEY=VALUE`` flag. So a
field is written down once. Every role also gets ``--config FILE`` (TOML; ``.json`` still read)
and ``--print-config`` (the effective config as TOML, which ``--config`` reads back unchanged).
Precedence: field default < config file < flag.

:func:`configured` is what a role's ``run`` calls: the effective config, or an exit code after a
one-line error (2) or ``--print-config`` (0). Nothing here imports torch.

Fields shared by several roles are defined once here (:class:`ModelFields`, :class:`PeerFields`)
or beside the learner (``learner/config.py``) and reused by inheritance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

T = TypeVar("T", bound="Section")


@dataclass(frozen=True)
class Flag:
    """Annotated metadata of a field whose flag is not ``--<field-name>`` (kept for old command
    lines), or whose ``KEY=VALUE`` items need a typed parser."""

    name: str
    metavar: str | None = None
    parse: Callable[[list[str]], dict[str, Any]] | None = None


class Section(BaseModel):
    """Base of every role config: unknown keys are errors, docstrings are the help text,
    assignments are validated like construction."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ConfigError(ValueError):
    """A config the role refuses: one line, exit 2."""


Device = Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d{1,2})?)$")]
UploadMbps = Annotated[
    float,
    Field(
        ge=0.0,
        le=1e6,
        description="upload cap in Mbit/s (broadcast, relaying, "
        "direct fetch); about 0.95 x the real uplink keeps "
        "the link's queue empty; 0: none",
    ),
]

MetricsPort = Annotated[
    str,
    Field(
        pattern=r"^(\S{1,253}:)?\d{1,5}$|^$",
        description="serve Prometheus /metrics on PORT (127.0.0.1) or HOST:PORT (names in docs/metrics.md)",
    ),
]


class ModelFields(Section):
    """Which model a role runs and where."""

    model: str = ""
    """Hugging Face model directory (default: the shipped tiny model, actor/default_model)"""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """seed of prompts and sampling (the built-in model is the same for every seed)"""
    device: Device = "auto"
    """torch device: auto (cuda if available, else cpu), cpu, cuda or cuda:N; asking for CUDA where
    there is none is an error, never a silent fallback"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """weight dtype: auto is bfloat16 on cuda, float32 on cpu"""

    def check_model(self) -> None:
        """A given ``model`` must be an HF directory: said now, before anything heavy loads."""
        if self.model and not (Path(self.model).expanduser() / "config.json").is_file():
            raise ConfigError(f"--model {self.model} is not a Hugging Face model directory (no config.json)")


class PeerFields(Section):
    """What every networked peer (learner, node) has."""

    run_id: str = Field("echorl-demo", min_length=1, max_length=128)
    """identity of the run (a node joins only this run; a learner keeps it across --resume)"""
    listen: str = "/ip4/127.0.0.1/tcp/0"
    """multiaddr to listen on (/ip4/0.0.0.0/tcp/PORT for peers on other machines: the interface
    addresses are advertised, never 0.0.0.0)"""
    announce: Annotated[list[str], Flag("--announce", metavar="ADDR")] = []
    """public address to advertise before the interface ones, e.g. /ip4/203.0.113.7/tcp/4001 when
    peers reach this machine through NAT or a forwarded port (repeatable)"""
    upload_mbps: UploadMbps = 0.0
    log_level: Literal["debug", "info", "warning"] = "info"
    """console detail: info is a progress line every 10 s and what needs attention; debug adds every
    broadcast, lease expiry and step"""
    chunk_cache_mb: float = Field(64.0, ge=1.0, le=1024.0 * 1024)
    """memory for weight chunks in transit (MiB); the weights themselves live in files, so this,
    not the model's size, bounds what relaying a version costs in RAM"""
    metrics_port: MetricsPort = ""


# --- the command line ------------------------------------------------------------------------
def _flag(name: str, info: Any) -> Flag:
    for meta in info.metadata:
        if isinstance(meta, Flag):
            return meta
    return Flag("--" + name.replace("_", "-"))


def _show(value: Any) -> str:
    return (
        json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    )


def _help(info: Any) -> str:
    text = (info.description or "").replace("%", "%%")
    if info.is_required():
        return text + " (required)"
    default = info.get_default(call_default_factory=True)  # a default_factory's value, not PydanticUndefined
    if default in ("", {}, []) or "default" in text:
        return text
    return f"{text} (default: {_show(default).replace('%', '%%')})"


def _with(text: str, note: str) -> str:
    """``text`` with `` (note)`` appended, unless the field's own help already says it."""
    return text if note.split(";")[0] in text else f"{text} ({note})"


def _key_values(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item!r} must look like key=value")
        out[key] = value
    return out


_METAVARS: dict[Any, str] = {int: "N", float: "X"}


def add_arguments(parser: argparse.ArgumentParser, cls: type[Section]) -> None:
    """One flag per field of ``cls`` (none has a default here: an absent flag leaves the file's
    or the field's value), plus ``--config`` and ``--print-config``."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML file of this command's settings (flags override it; --print-config writes one)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the effective settings as TOML and exit")
    for name, info in cls.model_fields.items():
        flag = _flag(name, info)
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": _help(info)}
        origin = typing.get_origin(info.annotation)
        if info.annotation is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kw["choices"] = list(typing.get_args(info.annotation))
        elif origin is dict:
            kw.update(action="append", metavar=flag.metavar or "KEY=VALUE")
            kw["help"] = _with(kw["help"], "repeatable; replaces the config file's entries")
        elif origin is list:
            kw.update(action="append", metavar=flag.metavar)
            kw["help"] = _with(kw["help"], "repeatable")
        else:
            kw["metavar"] = flag.metavar or _METAVARS.get(info.annotation, "TEXT")
        parser.add_argument(flag.name, **kw)


# --- files -----------------------------------------------------------------------------------
def _read_file(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    try:
        data = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of settings")
    return data


def _flag_values(cls: type[Section], args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for name, info in cls.model_fields.items():
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if typing.get_origin(info.annotation) is dict:
            value = (_flag(name, info).parse or _key_values)(value)
        out[name] = value
    return out


def _describe(cls: type[Section], exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else ""
        info = cls.model_fields.get(name)
        where = f"{_flag(name, info).name} ({name})" if info else name
        if err["type"] == "missing":
            parts.append(f"{where} is required")
            continue
        got = err.get("input")
        parts.append(f"{where}: {err['msg']}" + (f" (got {got!r})" if not isinstance(got, dict) else ""))
    return "; ".join(parts)


def load(cls: type[T], args: argparse.Namespace, role: str) -> T:
    """Field defaults, then ``--config``, then the flags given; :class:`ConfigError` if the result
    is not a valid ``cls``."""
    data: dict[str, Any] = _read_file(args.config) if getattr(args, "config", None) else {}
    unknown = set(data) - set(cls.model_fields)
    if unknown:
        raise ConfigError(f"unknown {role} config keys: {sorted(unknown)}")
    try:
        data.update(_flag_values(cls, args))
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(cls, exc)) from None
    except ValueError as exc:  # a KEY=VALUE item the field's parser refuses
        raise ConfigError(str(exc)) from None


def configured(cls: type[T], args: argparse.Namespace, role: str) -> T | int:
    """The effective config of ``role``, or the exit code when there is nothing to run: 2 after a
    one-line error on stderr, 0 after ``--print-config``."""
    try:
        cfg = load(cls, args, role)
    except (OSError, ConfigError) as exc:
        fail(role, exc)
        return 2
    if getattr(args, "print_config", False):
        sys.stdout.write(to_toml(cfg))
        return 0
    return cfg


def fail(role: str, exc: BaseException | str) -> None:
    """The one line a refused command prints."""
    print(f"echorl {role}: {exc}", file=sys.stderr)


# --- TOML out --------------------------------------------------------------------------------
def _toml_str(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif (ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def to_toml(cfg: Section) -> str:
    """The config as TOML: scalars first, then one table per dict field (no nesting deeper)."""
    data = cfg.model_dump()
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict) and v is not None]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]", *(f"{_toml_str(str(kk))} = {_toml_value(vv)}" for kk, vv in v.items())]
    return "\n".join(lines) + "\n"


__all__ = [
    "ConfigError",
    "Flag",
    "ModelFields",
    "PeerFields",
    "Section",
    "add_arguments",
    "configured",
    "fail",
    "load",
    "to_toml",
]
