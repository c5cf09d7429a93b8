"""``python -m xlog_actors.cli.bench profile|decompose [--driver host] [--ops N]``."""

import sys

from .profile import main

sys.exit(main())
