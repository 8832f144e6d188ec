"""Layer 9, tools: the ``zarrckpt`` command (``cli``) and its operations as functions
(``inspect``), and the converters (``convert``).
"""

__all__: list[str] = []  # nothing re-exported: import the modules
