"""An application factory for running Narwhal under Hypercorn directly.

::

    NARWHAL_CONFIG=config.toml hypercorn -k trio --bind 127.0.0.1:8000 'narwhal.asgi:app()'

``narwhal serve --config config.toml`` does the same and also honours ``serving.bind`` and
``control.drain_deadline_s``; this entry point is for deployments that manage Hypercorn
themselves.

With ``serving.controller_socket`` set, the app is a relay worker
(:func:`narwhal.workers.worker.create_worker_app`) of the admission controller that ``narwhal
controller --config config.toml`` runs on that socket, so that Hypercorn's own worker
processes share one queue, one set of limits and one set of books::

    narwhal controller --config config.toml &
    NARWHAL_CONFIG=config.toml hypercorn -k trio -w 4 --bind 127.0.0.1:8000 'narwhal.asgi:app()'
"""

from __future__ import annotations

import os

from quart_trio import QuartTrio

from narwhal.config import load_config
from narwhal.web.app import create_app

__all__ = ["CONFIG_ENV", "app"]

CONFIG_ENV = "NARWHAL_CONFIG"


def app() -> QuartTrio:
    """Build the app from the file named by ``$NARWHAL_CONFIG`` (default ``config.toml``): a
    relay worker of the controller on ``serving.controller_socket`` when that is set, else the
    whole router in this process."""
    config = load_config(os.environ.get(CONFIG_ENV, "config.toml"))
    if config.serving.controller_socket:
        from narwhal.workers.worker import create_worker_app

        return create_worker_app(config, config.serving.controller_socket)
    return create_app(config)
