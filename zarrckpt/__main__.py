"""``python -m zarrckpt``: the ``zarrckpt`` command (:mod:`zarrckpt.tools.cli`)."""

import sys

from .tools.cli import main

__all__: list[str] = []

sys.exit(main())
