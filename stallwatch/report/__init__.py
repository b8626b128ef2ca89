"""The warm-up report: a source builds a `Run` (`prometheus`, `windows`), `render` draws it as one HTML page,
`command` is `stallwatch report`."""
