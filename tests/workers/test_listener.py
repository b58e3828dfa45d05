"""The controller's Unix socket: private, and never taken from a live controller."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import trio

from narwhal.workers.controller import open_controller_listener

pytestmark = pytest.mark.realtime


async def test_the_socket_is_its_owners_and_a_live_one_is_not_taken_over(tmp_path: Path) -> None:
    path = str(tmp_path / "controller.sock")
    with trio.fail_after(10):
        listener = await open_controller_listener(path)
        try:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            with pytest.raises(OSError, match="already listens"):
                await open_controller_listener(path)
        finally:
            await listener.aclose()
        # The first controller is gone and left its socket file: the next one replaces it.
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        again = await open_controller_listener(path)
        await again.aclose()
