"""A small model of a Grafana dashboard (rows of panels, each answering one question) and its rendering.

`dashboards.py` declares the dashboards in this model; this module turns them into the JSON
that Grafana imports, through grafana-foundation-sdk (Grafana's own typed builders, current schema), and
into the panel tables of docs/dashboards.md. Layout (grid positions, panel ids) is computed here, so the
declarations hold only what a reader needs: title, question, visualisation, unit, queries.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from enum import Enum

with warnings.catch_warnings():  # the SDK warns at import that a v2 dashboard model exists; Grafana reads v1
    warnings.simplefilter("ignore", DeprecationWarning)
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.builders import dashboard as dashboard_builders
    from grafana_foundation_sdk.builders import heatmap, prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

GRID_WIDTH = 24
TAG = "stallwatch"  # every dashboard carries it; their links list the dashboards with it
DATASOURCE = common_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
STATE_COLORS = ("blue", "orange", "green", "red")


class Viz(Enum):
    TIMESERIES = "timeseries"
    STAT = "stat"
    HEATMAP = "heatmap"
    TABLE = "table"
    STATE_TIMELINE = "state-timeline"


HEIGHTS = {Viz.STAT: 5, Viz.STATE_TIMELINE: 6}


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    question: str  # shown as the panel's description and in docs/dashboards.md
    viz: Viz
    unit: str  # a Grafana unit id: percentunit, s, bytes, Bps, currencyUSD, ...
    queries: tuple[Query, ...]
    width: int = 12
    stacked: bool = False
    thresholds: tuple[float, ...] = ()  # drawn as lines: green below the first, orange, then red
    states: tuple[str, ...] = ()  # state timeline: value i is shown as states[i]


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    """A dashboard variable: a Prometheus label's values, a free-text value, or the data source."""

    name: str
    label: str
    query: str = ""  # label_values(...) for a label variable
    text: str = ""  # default of a free-text variable
    description: str = ""


@dataclass(frozen=True)
class Annotation:
    name: str
    expr: str
    title: str
    color: str


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    annotations: tuple[Annotation, ...] = ()

    def panels(self) -> tuple[Panel, ...]:
        return tuple(p for row in self.rows for p in row.panels)


DATASOURCE_VARIABLE = Variable("datasource", "Data source")


# --- rendering to Grafana JSON -----------------------------------------------------------------------
def _target(query: Query, viz: Viz, ref_id: str) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(query.expr).ref_id(ref_id).datasource(DATASOURCE)
    if query.legend:
        target = target.legend_format(query.legend)
    if viz is Viz.HEATMAP:
        target = target.format(prometheus_models.PromQueryFormat.HEATMAP)
    if viz is Viz.TABLE:
        target = target.instant().format(prometheus_models.PromQueryFormat.TABLE)
    return target


def _legend() -> common_builders.VizLegendOptions:
    return (common_builders.VizLegendOptions().show_legend(True)
            .display_mode(common_models.LegendDisplayMode.LIST).placement(common_models.LegendPlacement.BOTTOM))


def _thresholds(values: tuple[float, ...]) -> dashboard_builders.ThresholdsConfig:
    colors = ["green", "orange", "red"][: len(values) + 1]
    steps = [dashboard_models.Threshold(value=None, color=colors[0])]
    steps += [dashboard_models.Threshold(value=v, color=colors[min(i + 1, 2)]) for i, v in enumerate(values)]
    return dashboard_builders.ThresholdsConfig().mode(dashboard_models.ThresholdsMode.ABSOLUTE).steps(steps)


def _state_mappings(states: tuple[str, ...]) -> list[dashboard_models.ValueMapping]:
    options = {
        str(i): dashboard_models.ValueMappingResult(text=name, color=STATE_COLORS[i % len(STATE_COLORS)], index=i)
        for i, name in enumerate(states)
    }
    return [dashboard_models.ValueMap(options=options)]


PanelBuilder = timeseries.Panel | stat.Panel | heatmap.Panel | table.Panel | statetimeline.Panel


def _visualisation(panel: Panel) -> PanelBuilder:
    if panel.viz is Viz.TIMESERIES:
        series = timeseries.Panel().legend(_legend()).fill_opacity(20 if panel.stacked else 0)
        if panel.stacked:
            series = series.stacking(common_builders.StackingConfig().mode(common_models.StackingMode.NORMAL))
        if panel.thresholds:
            series = series.thresholds_style(
                common_builders.GraphThresholdsStyleConfig().mode(common_models.GraphThresholdsStyleMode.LINE))
        return series
    if panel.viz is Viz.STAT:
        return stat.Panel().reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
    if panel.viz is Viz.HEATMAP:
        return (heatmap.Panel().calculate(False).show_legend()
                .y_axis(heatmap.YAxisConfig().unit(panel.unit)))
    if panel.viz is Viz.TABLE:
        return table.Panel()
    timeline = statetimeline.Panel().legend(_legend())
    return timeline.mappings(_state_mappings(panel.states)) if panel.states else timeline


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> PanelBuilder:
    builder = (_visualisation(panel).id(panel_id).title(panel.title).description(panel.question)
               .datasource(DATASOURCE).unit(panel.unit)
               .grid_pos(dashboard_models.GridPos(h=HEIGHTS.get(panel.viz, 8), w=panel.width, x=x, y=y))
               .targets([_target(q, panel.viz, chr(ord("A") + i)) for i, q in enumerate(panel.queries)]))
    if panel.thresholds:
        builder = builder.thresholds(_thresholds(panel.thresholds))
    return builder


def _variable(variable: Variable) -> dashboard_builders.DatasourceVariable | dashboard_builders.QueryVariable | (
        dashboard_builders.TextBoxVariable):
    if variable == DATASOURCE_VARIABLE:
        return dashboard_builders.DatasourceVariable(variable.name).label(variable.label).type("prometheus")
    if variable.query:
        return (dashboard_builders.QueryVariable(variable.name).label(variable.label).datasource(DATASOURCE)
                .query(variable.query).definition(variable.query).multi(True).include_all(True).all_value(".*")
                .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(dashboard_models.VariableSort.NATURAL_ASC).description(variable.description))
    return (dashboard_builders.TextBoxVariable(variable.name).label(variable.label).default_value(variable.text)
            .current(dashboard_models.VariableOption(selected=True, text=variable.text, value=variable.text))
            .description(variable.description))


def build(dashboard: Dashboard, siblings: tuple[Dashboard, ...]) -> dict[str, object]:
    """The dashboard as Grafana's JSON model, linking to its siblings (time range and variables kept)."""
    builder = (dashboard_builders.Dashboard(dashboard.title).uid(dashboard.uid).description(dashboard.description)
               .tags([TAG]).editable().refresh("30s").time("now-3h", "now")
               .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR))
    for variable in (DATASOURCE_VARIABLE, *dashboard.variables):
        builder = builder.with_variable(_variable(variable))
    if len(siblings) > 1:
        # Links by tag, not by URL: Grafana resolves them itself, so they work under a sub-path
        # (root_url .../grafana/) where an absolute `/d/uid` would leave Grafana.
        builder = builder.link(dashboard_builders.DashboardLink("stallwatch")
                               .type(dashboard_models.DashboardLinkType.DASHBOARDS).tags([TAG])
                               .as_dropdown(False).include_vars(True).keep_time(True).icon("dashboard"))
    for annotation in dashboard.annotations:
        builder = builder.annotation(dashboard_builders.AnnotationQuery().name(annotation.name)
                                     .datasource(DATASOURCE).expr(annotation.expr).title_format(annotation.title)
                                     .enable(True).icon_color(annotation.color))
    panel_id, y = 0, 0
    for row in dashboard.rows:
        panel_id += 1
        builder = builder.with_row(dashboard_builders.Row(row.title).id(panel_id)
                                   .grid_pos(dashboard_models.GridPos(h=1, w=GRID_WIDTH, x=0, y=y)))
        y += 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            panel_id += 1
            builder = builder.with_panel(_panel(panel, panel_id, x, y))
            x += panel.width
            line_height = max(line_height, HEIGHTS.get(panel.viz, 8))
        y += line_height
    document: dict[str, object] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    return document


def render_json(dashboard: Dashboard, siblings: tuple[Dashboard, ...]) -> str:
    return json.dumps(build(dashboard, siblings), indent=2, sort_keys=True) + "\n"


# --- rendering to markdown ---------------------------------------------------------------------------
def render_markdown(dashboards: tuple[Dashboard, ...], source: str) -> str:
    lines = [
        "# Dashboards",
        "",
        f"Generated by `make generate` from `{source}`; do not edit by hand. Import the JSON files of",
        "`dashboards/` into Grafana (or let the Helm chart provision them). Every dashboard has a `datasource`",
        "variable (any Prometheus), a `cluster` variable (the scrape's `cluster` label; All where there is",
        "none), links to the others that keep the time range and the variables (links by the `stallwatch` tag,",
        "so they work when Grafana is served under a sub-path), and units on every panel; shares of time are",
        "percentages. The training job is the `training_job` label (`job` stays the scrape job's, so no",
        "`honor_labels` is needed); Prometheus must label each target with its `node` name: the chart's",
        "ServiceMonitor does (from the pod's node), and so do `deploy/prometheus/scrape-*.yml` (from the",
        "target's host). Nodes are chosen and shown by that name, never by the scrape address; on the",
        "training dashboard the variables chain job -> node -> GPU, and the GPU series shown are those of the",
        "chosen jobs. Where dcgm-exporter runs, its `DCGM_FI_PROF_SM_ACTIVE` is drawn beside NVML's",
        "utilization, matched to stallwatch's GPUs by UUID; without it that series is simply absent.",
    ]
    for dashboard in dashboards:
        variables = ", ".join(f"`{v.name}`" for v in (DATASOURCE_VARIABLE, *dashboard.variables))
        lines += ["", f"## {dashboard.title}", "", f"`dashboards/{dashboard.uid}.json`, uid `{dashboard.uid}`: "
                  f"{dashboard.description}", "", f"Variables: {variables}."]
        if dashboard.annotations:
            lines += ["", "Annotations: " + "; ".join(f"{a.name}" for a in dashboard.annotations) + "."]
        for row in dashboard.rows:
            lines += ["", f"### {row.title}", "", "| panel | shows | unit | the question it answers |",
                      "|---|---|---|---|"]
            lines += [f"| {p.title} | {p.viz.value} | `{p.unit}` | {p.question} |" for p in row.panels]
    return "\n".join(lines) + "\n"
