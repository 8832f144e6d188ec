"""Layer 5, torch.distributed and devices: ``group`` is the only module that calls
``torch.distributed``; ``staging`` copies device memory to reused pinned host memory.
"""

__all__: list[str] = []  # nothing re-exported: import the modules
