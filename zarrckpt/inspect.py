"""``zarrckpt.inspect``: the public name of :mod:`zarrckpt.tools.inspect`."""

from .tools.inspect import *  # noqa: F403 - re-exported as it is
from .tools.inspect import __all__  # noqa: F401
