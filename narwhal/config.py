"""Configuration: frozen attrs classes loaded from TOML, strictly.

Every key of the documented contract is here with its default. Unknown keys and values of the wrong
type are refused with the key's dotted path (``admission.queue_limit``,
``engines[1].dialect``), so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import attrs
import orjson

__all__ = [
    "AdminConfig",
    "AdmissionConfig",
    "Config",
    "ConfigError",
    "ControlConfig",
    "EngineConfig",
    "MaintenanceConfig",
    "MonitoringConfig",
    "ServingConfig",
    "UpstreamConfig",
    "api_key_from",
    "check_bind",
    "check_resources",
    "config_from_mapping",
    "config_to_mapping",
    "config_to_toml",
    "load_config",
]

Dialect = Literal["vllm", "sglang", "openai"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the dotted key."""


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"must be greater than 0, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ConfigError(f"must be 0 or greater, got {value!r}")


def _fraction(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0 <= value <= 1:
        raise ConfigError(f"must be between 0 and 1, got {value!r}")


def check_bind(value: str) -> None:
    """Check that ``value`` is ``HOST:PORT`` with a port from 0 to 65535 (``serving.bind``).

    Raises:
        ConfigError: it is not.
    """
    host, sep, port = value.rpartition(":")
    digits = port.isascii() and port.isdigit()
    if not sep or not host or not digits or not 0 <= int(port) <= 65535:
        raise ConfigError(f"must be HOST:PORT with a port from 0 to 65535, got {value!r}")


def _bind(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    check_bind(value)


def _optional_bind(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value:
        check_bind(value)


def _profile(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    from narwhal.scheduling.profiles import PROFILES

    if value not in PROFILES:
        known = ", ".join(repr(name) for name in sorted(PROFILES))
        raise ConfigError(f"unknown profile {value!r} (known: {known})")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _api_key_env(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value:
        api_key_from(value)


def api_key_from(variable: str) -> str:
    """The API key held by the environment variable ``variable`` (``engines[].api_key_env``).

    Error messages name the variable, never its value.

    Raises:
        ConfigError: ``variable`` is not a variable's name, is unset or empty, or holds
            something that cannot be sent as a bearer token (printable ASCII without spaces).
    """
    if not _ENV_NAME.fullmatch(variable):
        # Not echoed: it may be the key itself, written where its variable's name belongs.
        raise ConfigError(
            "must be the name of an environment variable holding the key (letters, digits and "
            "underscores), never the key itself"
        )
    key = os.environ.get(variable)
    if key is None:
        raise ConfigError(f"the environment variable {variable} is not set")
    if not key:
        raise ConfigError(f"the environment variable {variable} is empty")
    if not (key.isascii() and key.isprintable()) or " " in key:
        raise ConfigError(
            f"the environment variable {variable} does not hold a usable API key "
            "(printable ASCII without spaces)"
        )
    return key


def _url(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value.startswith(("http://", "https://")):
        raise ConfigError(f"must be an http:// or https:// URL, got {value!r}")


@attrs.frozen
class ServingConfig:
    """``[serving]``: what is served and where."""

    model: str = "llama-3.1-8b-instruct"
    bind: str = attrs.field(default="127.0.0.1:8000", validator=_bind)
    max_request_bytes: int = attrs.field(default=1_048_576, validator=_positive)
    request_deadline_s: float = attrs.field(default=300.0, validator=_positive)
    tokenizer: str = ""  # path to a local tokenizer.json; empty: estimate from characters
    # The longest from a connection (or the end of the previous response) to a complete request
    # head: 408 and close after.
    header_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    # The longest a client may take to send a whole request body (408 after).
    body_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    # HOST:PORT of the probe listener (narwhal.web.probes): /health and /ready answered from
    # their own thread, whatever the event loop is doing. Empty: none.
    probe_bind: str = attrs.field(default="", validator=_optional_bind)
    # Relay worker processes under one admission controller (narwhal.workers): 1 serves in one
    # process, as embedded.
    workers: int = attrs.field(default=1, validator=_positive)
    # The controller's Unix socket path: where the relay workers reach it (``narwhal serve``
    # makes a private one when empty; ``narwhal controller`` and Hypercorn's own workers
    # need it set).
    controller_socket: str = ""


@attrs.frozen
class AdmissionConfig:
    """``[admission]``: limits and the TTFT budget."""

    mode: Literal["open", "predictive", "shadow"] = "predictive"
    http_retention_limit: int = attrs.field(default=1024, validator=_positive)
    queue_limit: int = attrs.field(default=256, validator=_positive)
    admission_wait_s: float = attrs.field(default=20.0, validator=_positive)
    ttft_budget_s: float = attrs.field(default=2.0, validator=_positive)
    prefill_concurrency: int = attrs.field(default=4, validator=_positive)
    decode_concurrency: int = attrs.field(default=128, validator=_positive)
    frontend_overhead_s: float = attrs.field(default=0.005, validator=_non_negative)
    tpot_target_s: float = attrs.field(default=0.1, validator=_positive)


@attrs.frozen
class UpstreamConfig:
    """``[upstream]``: transport settings shared by every engine's HTTP client."""

    connect_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    read_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    max_connections: int = attrs.field(default=512, validator=_positive)


@attrs.frozen
class EngineConfig:
    """One ``[[engines]]`` entry."""

    name: str
    url: str = attrs.field(validator=_url)
    dialect: Dialect = "vllm"
    wave: str = "a"
    profile: str = attrs.field(default="h100-llama3-8b", validator=_profile)
    token_ids: bool | None = None
    prefill_concurrency: int | None = attrs.field(default=None, validator=_positive)
    decode_concurrency: int | None = attrs.field(default=None, validator=_positive)
    # The name of the environment variable holding the engine's API key (vLLM's --api-key);
    # empty: none. The key itself is never in the configuration.
    api_key_env: str = attrs.field(default="", validator=_api_key_env)

    @property
    def wants_token_ids(self) -> bool:
        """Whether to ask this engine for token IDs (default: only the vllm dialect)."""
        return self.dialect == "vllm" if self.token_ids is None else self.token_ids

    def api_key(self) -> str | None:
        """The engine's API key, read from ``api_key_env`` now; ``None`` without one.

        Raises:
            ConfigError: the variable is no longer set (or usable); the message names the key.
        """
        if not self.api_key_env:
            return None
        try:
            return api_key_from(self.api_key_env)
        except ConfigError as exc:
            raise ConfigError(f"engine {self.name}: api_key_env: {exc}") from None


@attrs.frozen
class ControlConfig:
    """``[control]``: HA lease and shutdown."""

    lease: Literal["none", "etcd"] = "none"
    etcd_endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)
    lease_ttl_s: float = attrs.field(default=5.0, validator=_positive)
    cluster: str = "narwhal"
    drain_deadline_s: float = attrs.field(default=30.0, validator=_non_negative)


@attrs.frozen
class MonitoringConfig:
    """``[monitoring]``: engine polls and the router's own health."""

    poll_interval_s: float = attrs.field(default=1.0, validator=_positive)
    poll_timeout_s: float = attrs.field(default=1.0, validator=_positive)
    failure_threshold: int = attrs.field(default=3, validator=_positive)
    breaker_open_s: float = attrs.field(default=5.0, validator=_positive)
    stale_after_s: float = attrs.field(default=5.0, validator=_positive)
    max_loop_lag_s: float = attrs.field(default=0.25, validator=_positive)
    # The watchdog (narwhal.control.watchdog): how long the loop lag must stay over
    # max_loop_lag_s before the router is monitoring-degraded, and how long everything must
    # look right again before it recovers.
    lag_sustain_s: float = attrs.field(default=1.0, validator=_positive)
    recover_after_s: float = attrs.field(default=2.0, validator=_positive)
    # Probe engines before they join, and again when they drift (narwhal.upstream.profiling).
    profiling: bool = True


@attrs.frozen
class MaintenanceConfig:
    """``[maintenance]``: the capacity guard of maintenance waves."""

    min_capacity_share: float = attrs.field(default=0.5, validator=_fraction)


@attrs.frozen
class AdminConfig:
    """``[admin]``: who may use the admin routes."""

    token: str = ""
    allow_loopback_without_token: bool = False


def _unique_engine_names(
    instance: object, attribute: attrs.Attribute[Any], value: tuple[EngineConfig, ...]
) -> None:
    seen: set[str] = set()
    for engine in value:
        if engine.name in seen:
            raise ConfigError(f"engine name {engine.name!r} is used twice")
        seen.add(engine.name)


@attrs.frozen
class Config:
    """The whole configuration."""

    serving: ServingConfig = ServingConfig()
    admission: AdmissionConfig = AdmissionConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    engines: tuple[EngineConfig, ...] = attrs.field(default=(), validator=_unique_engine_names)
    control: ControlConfig = ControlConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    maintenance: MaintenanceConfig = MaintenanceConfig()
    admin: AdminConfig = AdminConfig()


# -- loading ------------------------------------------------------------------------------------


def load_config(path: str | Path, *, engines_required: bool = True) -> Config:
    """Read and validate a TOML configuration file.

    Args:
        path: the file.
        engines_required: a file without an ``[[engines]]`` table is an error (not: the
            caller supplies the engines, as the benchmarks' ``--narwhal-config`` does).

    Raises:
        ConfigError: the file is missing or unreadable, is not UTF-8 TOML, or holds an unknown
            key, a bad value or (``engines_required``) no engine. The message starts with the
            path.
    """
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such file") from exc
    except OSError as exc:  # a folder, no permission
        raise ConfigError(f"{path}: cannot read the file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return config_from_mapping(data, engines_required=engines_required)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def check_resources(config: Config) -> None:
    """Check what the configuration names outside itself (a tokenizer file) can be used.

    Raises:
        ConfigError: a named file cannot be loaded; the message names the key.
    """
    if config.serving.tokenizer:
        from narwhal.admission.sizing import TokenizerCounter

        try:
            TokenizerCounter.from_file(config.serving.tokenizer)
        except RuntimeError as exc:
            raise ConfigError(f"serving.tokenizer: {exc}") from exc


def config_from_mapping(data: Mapping[str, Any], *, engines_required: bool = True) -> Config:
    """Build a :class:`Config` from parsed TOML (or any mapping of the same shape).

    A configuration needs at least one ``[[engines]]`` table (a :class:`Config` built in code
    may have none), unless ``engines_required`` is false (the caller supplies them).

    Raises:
        ConfigError: an unknown key or a bad value, named by its dotted path, or no engine.
    """
    config: Config = _build(Config, data, "")
    if engines_required and not config.engines:
        raise ConfigError("engines: no [[engines]] table; the router needs at least one engine")
    return config


def _build(cls: type[Any], data: Any, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'the configuration'}: expected a table")
    hints = typing.get_type_hints(cls)
    fields = {field.name: field for field in attrs.fields(cls)}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{_join(path, key)}: unknown key (known keys: {known})")
    values = {}
    for name, value in data.items():
        values[name] = _convert(hints[name], value, _join(path, name))
    for name, field in fields.items():
        if name not in values and field.default is attrs.NOTHING:
            raise ConfigError(f"{_join(path, name)}: required key is missing")
    try:
        return cls(**values)
    except ConfigError as exc:
        # attrs validators do not know the path; find which field complained.
        raise ConfigError(f"{_locate(cls, values, path)}: {exc}") from None


def _locate(cls: type[Any], values: dict[str, Any], path: str) -> str:
    for field in attrs.fields(cls):
        if field.validator is None or field.name not in values:
            continue
        try:
            field.validator(None, field, values[field.name])
        except ConfigError:
            return _join(path, field.name)
    return path or "the configuration"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = get_origin(hint)
    if attrs.has(hint):
        return _build(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in get_args(hint) if arg is not type(None)]
        return _convert(options[0], value, path)
    if origin is Literal:
        allowed = get_args(hint)
        if value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            raise ConfigError(f"{path}: must be one of {choices}, got {value!r}")
        return value
    if origin is tuple:
        item_hint = get_args(hint)[0]
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected an array, got {_kind(value)}")
        return tuple(_convert(item_hint, item, f"{path}[{i}]") for i, item in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {_kind(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_kind(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {_kind(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_kind(value)}")
        return value
    raise TypeError(f"{path}: unsupported configuration type {hint!r}")  # pragma: no cover


def _kind(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"{kinds.get(type(value), type(value).__name__)} ({value!r})"


def config_to_mapping(config: Config) -> dict[str, Any]:
    """The effective values, shaped like the TOML file (what ``check-config`` prints)."""
    data: dict[str, Any] = attrs.asdict(config)
    for engine, settings in zip(data["engines"], config.engines, strict=True):
        # Show what each engine really gets, not the unset overrides.
        engine["token_ids"] = settings.wants_token_ids
        engine["prefill_concurrency"] = (
            settings.prefill_concurrency or config.admission.prefill_concurrency
        )
        engine["decode_concurrency"] = (
            settings.decode_concurrency or config.admission.decode_concurrency
        )
    return data


def config_to_toml(config: Config) -> str:
    """The effective configuration as TOML text (loads back to the same values)."""
    lines: list[str] = []
    for section, values in config_to_mapping(config).items():
        tables = values if isinstance(values, list | tuple) else [values]
        header = f"[[{section}]]" if isinstance(values, list | tuple) else f"[{section}]"
        for table in tables:
            lines.append(header)
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
            lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, str):
        return orjson.dumps(value).decode()  # a JSON string is a valid TOML basic string
    return repr(value)
