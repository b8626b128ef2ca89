"""The streaming correlator: attributes worker stalls and GPU idle time to their causes."""

# One file, one module name: loaded from another path entry (`import correlator` with stallwatch/ on the
# path) this package would register its collectors and metrics a second time.
if __name__ != "stallwatch.correlator":
    raise ImportError(f"import stallwatch.correlator, not {__name__}: one file, one module name")
