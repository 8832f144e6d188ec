"""Layer 6, planning of torch state: ``state`` resolves Stateful objects and checks
leaves; ``plan`` lays out every leaf of a rank (chunks it writes, pieces it exchanges).
"""

__all__: list[str] = []  # nothing re-exported: import the modules
