"""Layer 5, torch.distributed and devices: ``group`` is the only module that calls
``torch.distributed``; ``staging`` copies device memory to reused pinned host memory.
"""
