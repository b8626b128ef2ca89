"""The demo end to end, short: a real hub behind an emulated region boundary, a real nginx spoke, a real
PyTorch DataLoader job through the real client, the real agent and correlator, a real Prometheus and
Alertmanager. The run's own metrics must agree with the spoke, the report and ground truth we know.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from stallwatch import catalogue as c
from stallwatch.demo.epochs import epoch_line
from stallwatch.demo.run import DEMO_THRESHOLDS, Demo, Outcome, Settings
from stallwatch.demo.stack import query
from stallwatch.mixin.alerts import training_alerts
from tests.conftest import ROOT, require_binary
from tests.dashqueries import dashboard_queries

pytestmark = pytest.mark.slow
ARTIFACTS = ROOT / "test-artifacts"
# A console line the report itself never writes: our probe reports how many figures decoded, and any error.
PROBE = """<script>
window.addEventListener('error', e => console.log('stallwatch-error ' + (e.message || e.target.src)), true);
window.addEventListener('load', () => {
  const figures = [...document.images];
  const drawn = figures.filter(i => i.complete && i.naturalWidth > 0).length;
  console.log('stallwatch-figures ' + drawn + '/' + figures.length);
});
</script>"""


DASHBOARD_REPLIES: list[tuple[str, str, str, bool, dict[str, Any]]] = []
STARVED = "StallwatchGPUsStarvedByRemoteFetches"
# The share of their time the job's GPUs idled in remote-fetch stalls, as the starved alert computes it
# (its expression less the threshold), at its highest over the run.
STARVED_SHARE = next(a.expr for a in training_alerts(DEMO_THRESHOLDS) if a.name == STARVED).rsplit(" > ", 1)[0]
HIGHEST_STARVED_SHARE: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    for binary, package in (("nginx", "nginx-light"), ("prometheus", "prometheus"),
                            ("prometheus-alertmanager", "prometheus-alertmanager")):
        require_binary(binary, package)
    settings = Settings(duration=50, shards=48, shard_mib=1, bandwidth_mbit=100, outage=True, outage_seconds=12,
                        quiet=True, workdir=tmp_path_factory.mktemp("demo"))

    def ask_every_dashboard_query(prometheus: str | None, agent: str) -> None:
        assert prometheus is not None
        for path, title, expr, is_panel in dashboard_queries():
            DASHBOARD_REPLIES.append((path, title, expr, is_panel, query(prometheus, expr)))
        HIGHEST_STARVED_SHARE.append(query(prometheus, f"max_over_time(({STARVED_SHARE})[5m:1s])"))

    return Demo(settings).run(while_running=ask_every_dashboard_query)


def value(outcome: Outcome, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in outcome.metrics.items()
               if n == name and all((k, x) in ls for k, x in labels.items()))


def test_the_clients_verdicts_agree_with_the_spokes_log(outcome: Outcome) -> None:
    # Workers read every shard through nginx and saw its X-Cache-Status; nginx logged the same requests.
    client_hits = value(outcome, c.DATASET_READS.name, verdict="hit")
    client_misses = value(outcome, c.DATASET_READS.name, verdict="miss")
    spoke_hits = value(outcome, c.SPOKE_REQUESTS.name, result="hit")
    spoke_misses = value(outcome, c.SPOKE_REQUESTS.name, result="miss")
    assert client_misses >= 48  # the cold epoch misses every shard
    assert (client_hits, client_misses) == (spoke_hits, spoke_misses)
    assert value(outcome, c.RECEIVER_DROPPED_EVENTS.name) == 0
    assert value(outcome, c.CLIENT_DROPPED_EVENTS.name) == 0


def test_stalls_are_attributed_to_remote_fetches_and_sum_to_the_stall(outcome: Outcome) -> None:
    causes = {cause: value(outcome, c.STALL_SECONDS.name, training_job="demo", cause=cause) for cause in c.CAUSES}
    total = sum(causes.values())
    # The cold epoch and the hub outage dominate the stall time, and both are reads that missed.
    assert causes["remote_fetch"] > 0.6 * total, causes
    # How long the outage stalls depends on when a read first misses in it; what must hold is that the
    # seconds the clients measured waiting are booked to causes (stalls are the waits over 1 ms: the
    # many short ones add little), and that the outage did make the job wait, once at least over 1 s.
    waits = value(outcome, c.LOADER_WAIT.name + "_sum", training_job="demo")
    assert 0.8 * waits <= total <= waits + 1e-6, (causes, waits)
    long_waits = (value(outcome, c.LOADER_WAIT.name + "_count", training_job="demo")
                  - value(outcome, c.LOADER_WAIT.name + "_bucket", training_job="demo", le="1.0"))
    assert long_waits >= 1
    idle = value(outcome, c.GPU_STALL_IDLE_SECONDS.name, training_job="demo", cause="remote_fetch")
    assert idle > 0.5 * causes["remote_fetch"]  # the emulated GPU idled through those stalls


def test_warmup_is_found_and_the_stall_alert_is_delivered(outcome: Outcome) -> None:
    steady_after = value(outcome, c.WARMUP_TIME_TO_STEADY.name, training_job="demo")
    assert 0 < steady_after < outcome.ended - outcome.started
    assert value(outcome, c.WARMUP_HUB_BYTES.name, training_job="demo") >= 48 * 2**20  # the whole dataset crossed once
    names = {alert["labels"]["alertname"] for alert in outcome.alerts}
    assert "StallwatchGPUsStarvedByRemoteFetches" in names, outcome.alerts
    starved = next(a for a in outcome.alerts if a["labels"]["alertname"] == "StallwatchGPUsStarvedByRemoteFetches")
    assert starved["labels"]["training_job"] == "demo" and starved["annotations"]["runbook_url"].endswith(
        "#stallwatchgpusstarvedbyremotefetches")


def test_every_dashboard_query_answers_on_the_live_stack(outcome: Outcome) -> None:
    assert len(DASHBOARD_REPLIES) >= 60
    empty = []
    for path, title, expr, is_panel, reply in DASHBOARD_REPLIES:
        assert reply["status"] == "success", f"{path} / {title}: {expr}: {reply}"
        if is_panel and not reply["data"]["result"]:
            empty.append(f"{path} / {title}")
    # What the demo has no source for: XIDs, Varnish/NFS/Qumulo-only metrics, a second spoke's what-if,
    # dcgm-exporter. The hub's round trip comes from the agent's probe of the demo's hub.
    assert len(empty) <= len(DASHBOARD_REPLIES) // 5, empty
    assert "dashboards/stallwatch-spoke.json / Hub round trip" not in empty


def test_report_numbers_are_the_runs_own(outcome: Outcome) -> None:
    html = outcome.report.read_text()
    shown = {key: re.search(rf'id="{key}">([^<]*)<', html).group(1)  # type: ignore[union-attr]
             for key in ("time-to-steady", "warmup-idle", "warmup-hub-bytes", "warmup-cost")}
    assert outcome.prometheus is not None  # the report came from Prometheus; the agent's own values:
    steady = value(outcome, c.WARMUP_TIME_TO_STEADY.name, training_job="demo")
    assert shown["time-to-steady"] == f"{steady:,.1f} s"
    hub = value(outcome, c.WARMUP_HUB_BYTES.name, training_job="demo")
    assert shown["warmup-hub-bytes"] == f"{hub / 1e9:,.3f} GB"
    assert shown["warmup-cost"] == f"${hub / 1e9 * 0.02:,.4f}"
    assert float(shown["warmup-idle"].removesuffix(" s")) == pytest.approx(
        value(outcome, c.WARMUP_IDLE_GPU_SECONDS.name, training_job="demo"), abs=0.06)
    assert html.count("data:image/png;base64,") == 5 and 'id="whatif"' in html


def test_report_renders_in_chromium_with_its_figures(outcome: Outcome, tmp_path: Path) -> None:
    chromium = require_binary("chromium", "chromium")
    page = tmp_path / "report.html"
    page.write_text(outcome.report.read_text().replace("<head>", "<head>" + PROBE, 1))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'p'}"]
    loaded = subprocess.run([chromium, *flags, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000",
                             "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    console = [line for line in loaded.stderr.splitlines() if ":CONSOLE" in line]
    assert any('"stallwatch-figures 5/5"' in line for line in console), loaded.stderr[-2000:]
    assert len(console) == 1, console  # nothing but the probe: no error, no warning from the page
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report.png"
    subprocess.run([chromium, *flags, "--window-size=1100,2400", f"--screenshot={shot}", outcome.report.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 50_000  # a page of figures, not a blank one


def test_the_chromium_probe_sees_a_broken_figure(tmp_path: Path) -> None:
    chromium = require_binary("chromium", "chromium")
    page = tmp_path / "broken.html"
    page.write_text(f"<html><head>{PROBE}</head><body><img src='data:image/png;base64,AAAA'></body></html>")
    loaded = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--disable-background-networking", f"--user-data-dir={tmp_path / 'p'}",
                             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000", "--dump-dom",
                             page.as_uri()], capture_output=True, text=True, timeout=120)
    console = [line for line in loaded.stderr.splitlines() if ":CONSOLE" in line]
    assert any('"stallwatch-figures 0/1"' in line for line in console), console
    assert any("stallwatch-error" in line for line in console), console


def test_each_epoch_line_gives_the_epochs_own_figures(outcome: Outcome) -> None:
    epochs = outcome.epochs
    assert [e.epoch for e in epochs] == list(range(1, len(epochs) + 1)) and len(epochs) >= 10
    assert all(epoch_line(e) in outcome.transcript for e in epochs)
    # Each of the spoke's requests and each second booked is in exactly one epoch.
    assert sum(e.requests for e in epochs) == value(outcome, c.SPOKE_REQUESTS.name)
    assert sum(e.hits for e in epochs) == value(outcome, c.SPOKE_REQUESTS.name, result="hit")
    assert sum(e.stall_seconds for e in epochs) == pytest.approx(value(outcome, c.STALL_SECONDS.name), abs=0.01)
    assert sum(e.compute_seconds for e in epochs) == pytest.approx(value(outcome, c.COMPUTE_SECONDS.name), abs=0.01)
    # The cold epoch reads each of the 48 shards once, every read a miss, and none of the next epoch's.
    assert (epochs[0].requests, epochs[0].hits, epochs[0].phases[0]) == (48, 0, "cold")
    # The outage's stall is the most input-bound epoch's, after the cut.
    worst = max(epochs, key=lambda e: e.input_bound_ratio or 0.0)
    assert outcome.cut_at is not None and worst.ended > outcome.cut_at and (worst.input_bound_ratio or 0) > 0.3


def test_the_time_to_steady_said_is_the_correlators_and_the_reports(outcome: Outcome) -> None:
    steady = value(outcome, c.WARMUP_TIME_TO_STEADY.name, training_job="demo")
    assert outcome.time_to_steady == steady
    said = [line for line in outcome.transcript if line.startswith("  steady:")]
    assert len(said) == 1 and f"time to steady {steady:.1f} s" in said[0], said
    assert f'id="time-to-steady">{steady:,.1f} s<' in outcome.report.read_text()


def test_gpus_never_idle_more_than_all_their_time(outcome: Outcome) -> None:
    reply = HIGHEST_STARVED_SHARE[0]
    highest = float(reply["data"]["result"][0]["value"][1])
    assert 0.05 < highest <= 1.0, reply  # the outage idles the one GPU, never more than wholly
    said = [float(m) for alert in outcome.alerts if alert["labels"]["alertname"] == STARVED
            for m in re.findall(r"([\d.]+)% of their time", alert["annotations"]["description"])]
    assert said and max(said) <= 100.0, said


def test_the_demo_says_where_its_files_stay(outcome: Outcome) -> None:
    work = outcome.report.parent
    assert outcome.transcript[-1].startswith(f"files left in {work}: ") and f"rm -r {work}" in outcome.transcript[-1]
