"""The node agent's collectors: one file each, registered by name, enabled by flag."""

# One file, one module name: loaded from another path entry (`import exporters` with stallwatch/ on the
# path) this package would register its collectors and metrics a second time.
if __name__ != "stallwatch.exporters":
    raise ImportError(f"import stallwatch.exporters, not {__name__}: one file, one module name")
