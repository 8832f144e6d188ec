"""Layer 1, the format: what lands on storage, as pure functions (no I/O, no torch).

``documents`` builds and parses every document of spec/format.md (roots, arrays, groups,
packed nodes, chunk keys, directory names); ``dtypes`` maps torch / Zarr / NumPy types;
``tree`` turns nested state into key paths and back (spec §4, §6.2); ``layout`` cuts a
global tensor into shards and chunks for a mesh and its placements (spec §5, Appendix C).
"""

__all__: list[str] = []  # nothing re-exported: import the modules
