"""``python -m narwhal`` is the ``narwhal`` command."""

import sys

from narwhal._entry import main

sys.exit(main())
