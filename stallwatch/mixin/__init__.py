"""The generator of stallwatch's monitoring artifacts, laid out like a monitoring mixin.

| module | what it holds |
|---|---|
| `generate.py` | the table of every generated file and the function that renders it; `stallwatch generate` |
| `config.py` | `Thresholds` (every threshold and `for`) and the names the alerts share |
| `rules.py` | the recording rules (`alerts/recording-rules.yaml`) |
| `alerts.py` | the alerting rules (`alerts/alerting-rules.yaml`), each with its runbook |
| `dashboards.py` | the three Grafana dashboards (`dashboards/*.json`) and docs/dashboards.md |
| `runbooks.py` | docs/runbooks.md: thresholds, recording rules, one section per alert |
| `metrics_doc.py` | docs/metrics.md, from the metric catalogue |
| `promql.py` | PromQL built from the metric catalogue (selectors checked against each metric's labels) |
| `prometheus.py` | the small rule-file model (groups of recording and alerting rules) and its YAML |
| `grafana.py` | the small dashboard model (rows of panels, each answering a question) and its rendering |
"""

if __name__ != "stallwatch.mixin":  # one file, one module name
    raise ImportError(f"import stallwatch.mixin, not {__name__}: one file, one module name")
