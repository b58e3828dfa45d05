"""Narwhal: an admission router for LLM inference.

The public surface: build the ASGI app with :func:`create_app`, or serve it from a Trio program
with :func:`serve`; configuration is :class:`Config`, loaded by :func:`load_config`.

They are imported on first use (PEP 562), so that ``import narwhal.anything`` does not load
Trio, Hypercorn and Quart first: the ``narwhal`` command starts cheaper, and a Ctrl-C while it
loads them is its own to answer (:mod:`narwhal._entry`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from narwhal.config import Config, ConfigError, load_config
    from narwhal.server import serve
    from narwhal.web.app import create_app

__all__ = ["Config", "ConfigError", "create_app", "load_config", "serve"]
__version__ = "0.4.0"

_HOMES = {
    "Config": "narwhal.config",
    "ConfigError": "narwhal.config",
    "load_config": "narwhal.config",
    "serve": "narwhal.server",
    "create_app": "narwhal.web.app",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'narwhal' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
