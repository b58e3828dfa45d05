"""``python -m narwhal`` is the ``narwhal`` command."""

import sys

from narwhal.cli import main

sys.exit(main())
