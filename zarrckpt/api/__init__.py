"""Layer 7, the torch API behind ``zarrckpt.save``/``load``/``async_save`` and the
``CheckpointManager``: adapters that plan with ``planning``, move data with
``distributed`` and write through the ``engine``.
"""

__all__: list[str] = []  # nothing re-exported: import the modules
