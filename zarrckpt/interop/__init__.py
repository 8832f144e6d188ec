__all__: list[str] = []  # nothing re-exported: import the modules
