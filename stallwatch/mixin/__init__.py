"""The generator of stallwatch's dashboards, rules and their docs, laid out like a monitoring mixin.

As in node-mixin and kubernetes-mixin: one config, the recording rules, the alerts, the dashboards, each
declared over the metric catalogue; the outputs stay at the top of the project, where users look for them.

| module | what it declares or renders | what it generates |
|---|---|---|
| `generate.py` | the table of every generated file and its renderer (`stallwatch generate`) | all below, chart copies |
| `config.py` | `Thresholds` (every threshold and `for`) and the names every alert shares | |
| `rules.py` | the recording rules | `alerts/recording-rules.yaml` |
| `alerts.py` | the alerting rules, each with its runbook | `alerts/alerting-rules.yaml` |
| `runbooks.py` | the thresholds, the recording rules, one section per alert | `docs/runbooks.md` |
| `dashboards.py` | the three Grafana dashboards, panel by panel | `dashboards/*.json`, `docs/dashboards.md` |
| `metrics_doc.py` | the metric catalogue as a table | `docs/metrics.md` |
| `promql.py` | PromQL from the catalogue, selectors checked against each metric's labels | |
| `prometheus.py` | the small rule-file model (groups of recording and alerting rules) and its YAML | |
| `grafana.py` | the small dashboard model (rows of panels, each answering a question) and its JSON | |
"""

if __name__ != "stallwatch.mixin":  # one file, one module name
    raise ImportError(f"import stallwatch.mixin, not {__name__}: one file, one module name")
