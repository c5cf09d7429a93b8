"""``python -m xlog_actors``: the ``xlog-actors`` command line."""

import sys

from .cli import main

sys.exit(main())
