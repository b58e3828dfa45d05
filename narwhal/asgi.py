"""An application factory for running Narwhal under Hypercorn directly.

::

    NARWHAL_CONFIG=config.toml hypercorn -k trio --bind 127.0.0.1:8000 'narwhal.asgi:app()'

``narwhal serve --config config.toml`` does the same and also honours ``serving.bind`` and
``control.drain_deadline_s``; this entry point is for deployments that manage Hypercorn
themselves.
"""

from __future__ import annotations

import os

from quart_trio import QuartTrio

from narwhal.config import load_config
from narwhal.web.app import create_app

__all__ = ["CONFIG_ENV", "app"]

CONFIG_ENV = "NARWHAL_CONFIG"


def app() -> QuartTrio:
    """Build the app from the file named by ``$NARWHAL_CONFIG`` (default ``config.toml``)."""
    return create_app(load_config(os.environ.get(CONFIG_ENV, "config.toml")))
