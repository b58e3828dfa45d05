"""Narwhal: an admission router for LLM inference.

The public surface: build the ASGI app with :func:`create_app`, or serve it from a Trio program
with :func:`serve`; configuration is :class:`Config`, loaded by :func:`load_config`.
"""

from narwhal.config import Config, ConfigError, load_config
from narwhal.server import serve
from narwhal.web.app import create_app

__all__ = ["Config", "ConfigError", "create_app", "load_config", "serve"]
__version__ = "0.4.0"
