"""``python -m zarrckpt``: the ``zarrckpt`` command (:mod:`zarrckpt.cli`)."""

import sys

from .cli import main

sys.exit(main())
