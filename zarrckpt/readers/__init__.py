"""Layer 4, the readers (torch-free): open a committed checkpoint, read boxes of its
arrays, walk and verify it. ``checkpoint`` (``zarrckpt.open``), ``lazy`` (``LazyArray``),
``walk`` (chunk-by-chunk traversal shared by verify/diff/stats), ``verify``.
"""

__all__: list[str] = []  # nothing re-exported: import the modules
