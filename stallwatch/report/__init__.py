"""The warm-up report: a source builds a `Run` (`prometheus`, `windows`), `render` draws it as one HTML page,
`command` is `stallwatch report`."""

if __name__ != "stallwatch.report":  # one file, one module name
    raise ImportError(f"import stallwatch.report, not {__name__}: one file, one module name")
