"""The ``narwhal`` command's entry point: :func:`narwhal.cli.main`, with a Ctrl-C that comes
before a command handles it (while Python loads the command's modules, say) ending the command
quietly with status 130 instead of a traceback."""

from __future__ import annotations

import sys


def main() -> int:
    """Run the ``narwhal`` command line; its exit status."""
    try:
        from narwhal.cli import main as run

        return run()
    except KeyboardInterrupt:
        print("narwhal: interrupted", file=sys.stderr)
        return 130
