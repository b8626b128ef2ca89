"""The generator of stallwatch's monitoring artifacts, laid out like a monitoring mixin.

| module | what it holds |
|---|---|
| `config.py` | `Thresholds` (every threshold and `for`) and the names the alerts share |
| `alerts.py` | the recording and alerting rules (`alerts/*.yaml`) and their runbooks (docs/runbooks.md) |
| `promql.py` | PromQL built from the metric catalogue (selectors checked against each metric's labels) |
| `grafana.py` | the small dashboard model (rows of panels, each answering a question) and its rendering |
"""

if __name__ != "stallwatch.mixin":  # one file, one module name
    raise ImportError(f"import stallwatch.mixin, not {__name__}: one file, one module name")
