"""Layer 3, the engine: spec §7 run once for every writer (torch-free).

``save`` runs claim, documents, chunks, flush, commit and abandon over a small group
protocol; ``commit`` holds the claim, publish and clean-up steps on storage; ``writer`` is
the one-process streaming writer that converters use.
"""

__all__: list[str] = []  # nothing re-exported: import the modules
