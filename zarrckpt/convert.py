"""``zarrckpt.convert``: the public name of :mod:`zarrckpt.tools.convert`."""

from .tools.convert import *  # noqa: F403 - re-exported as it is
from .tools.convert import __all__  # noqa: F401
