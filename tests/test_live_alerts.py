"""The shipped alerts through a hub outage as the live correlator books it, in the real promtool.

The correlator books an open stall's seconds as they accrue: every 0.5 s window is published on time,
stamped at its end, so through an outage the stall and GPU-idle counters rise with it, a few seconds
behind. promtool loads every input sample before it evaluates, so it cannot hold a sample back until it
is scrapeable; instead each correlator sample is placed at the time it becomes scrapeable at the latest,
`correlator_lag` for agents scraped every second (what the rules see at each instant, and a little later
than that: onsets are exact, ends late). The spoke's counters are stamped at the scrape and need no
shift. Input samples are a second apart, as scrapes every second would take them.

Two outages: fetches through the spoke fail (refused, timed out), or the hub accepts connections and answers
nothing, so no fetch fails and only the agents' probes of the hub (timing out) tell. Each alert must be raised
while the outage lasts (firing before it ends when its `for` is shorter than
the outage), have fired by its `for` plus the rate window plus 30 s after the cut, be firing then if the
outage still lasts, and be gone a rate window plus the rules' lag after the outage ends.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from stallwatch import catalogue as c
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.mixin.alerts import all_alerts
from stallwatch.mixin.config import COMPONENT, Thresholds, correlator_lag, duration_seconds
from stallwatch.mixin.generate import ARTIFACTS
from stallwatch.mixin.prometheus import AlertRule
from stallwatch.mixin.promql import selector
from tests.conftest import ROOT

T = Thresholds()
RULE_FILES = sorted(str(ROOT / path) for path in ARTIFACTS if path.startswith("alerts/"))
# The evaluation interval of the shipped Prometheus configuration: `for` is counted in its steps.
EVALUATION = yaml.safe_load((ROOT / "deploy/prometheus/scrape-static.yml").read_text())["global"][
    "evaluation_interval"]
SCRAPE = "1s"
ARRIVAL = round(duration_seconds(correlator_lag(CorrelatorSettings(), SCRAPE)))
RATE_WINDOW = round(duration_seconds(T.rate_window))
CUT = 10 * 60  # the hub goes away after the rate windows filled with steady training
JOB, SPOKE = "train", "spoke-1"
NODES = ("a", "b")
RANKS_PER_NODE = 2
STARVED = next(a for a in all_alerts(T) if a.name.endswith("GPUsStarvedByRemoteFetches"))
HUB_FAILING = next(a for a in all_alerts(T) if a.name.endswith("HubFailingWhileTrainingStalls"))
KEYS = {STARVED.name: {c.JOB_LABEL: JOB}, HUB_FAILING.name: {"spoke": SPOKE}}  # what each alert is raised for


@dataclass(frozen=True)
class Rates:
    """Per second, per rank (and its GPU) or per node: what each phase of the run adds to the counters."""

    stall_remote: float
    stall_cache: float
    hub_fetches: float
    hub_errors: float
    hits: float


STEADY = Rates(stall_remote=0.02, stall_cache=0.01, hub_fetches=5, hub_errors=0, hits=95)
# Every rank waits on a fetch that cannot succeed, its GPU idle; the node's loader workers retry their
# misses, each failing (a refused connection, a timeout): one failure every 2 s across the node.
OUTAGE = Rates(stall_remote=1.0, stall_cache=0, hub_fetches=0, hub_errors=0.5, hits=0)
# The hub accepts connections and answers nothing (a broken long-haul link): no fetch ends, so none fails
# within the spoke's timeout; only the agents' probes of the hub, timing out, say so.
HANGING = Rates(stall_remote=1.0, stall_cache=0, hub_fetches=0, hub_errors=0, hits=0)
# The agents' probes with the collector's defaults: one every 15 s, given up after 5 s. The first to time out
# ends at most interval + timeout after the cut; the first to succeed, an interval after the hub is back.
PROBE_INTERVAL, PROBE_TIMEOUT = 15, 5


@dataclass(frozen=True)
class Run:
    outage: int  # seconds
    during: Rates = OUTAGE

    @property
    def end(self) -> int:
        return CUT + self.outage

    @property
    def settled(self) -> int:
        """When every alert must be gone: the rate window and the rules' lag past the last late sample."""
        lag = round(duration_seconds(T.correlator_lag))
        return self.end + ARRIVAL + lag + RATE_WINDOW + round(duration_seconds(EVALUATION))

    def counter(self, rate: float, outage_rate: float, shift: int = 0) -> str:
        """promtool's values, a second apart, of a counter rising at `rate` but at `outage_rate` through the
        outage, each sample `shift` seconds after the time it counts up to."""
        phases = ((CUT + shift, rate), (self.outage, outage_rate), (self.settled + 60 - self.end - shift, rate))
        parts, value = ["0"], 0.0
        for seconds, per_second in phases:
            parts.append(f"{round(value + per_second, 6)}+{per_second}x{seconds - 1}")
            value += per_second * seconds
        return " ".join(parts)

    def probe_success(self) -> str:
        """promtool's values, a second apart, of a node's probe gauge: 0 from the first probe that timed out
        after the cut until the first that succeeds after the outage."""
        failing_from, failing_until = CUT + PROBE_INTERVAL + PROBE_TIMEOUT, self.end + PROBE_INTERVAL
        return f"1x{failing_from - 1} 0x{failing_until - failing_from - 1} 1x{self.settled + 60 - failing_until - 1}"

    def series(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for node in NODES:
            target = (f'instance="{node}:9842"', f'node="{node}"')
            for rank in range(RANKS_PER_NODE):
                who = (f'{c.JOB_LABEL}="{JOB}"', *target)
                for cause, steady, outage in (("remote_fetch", STEADY.stall_remote, self.during.stall_remote),
                                              ("cache_read", STEADY.stall_cache, self.during.stall_cache)):
                    stalled = self.counter(steady, outage, shift=ARRIVAL)
                    out[selector(c.STALL_SECONDS, *who, f'rank="{rank}"', f'cause="{cause}"')] = stalled
                    out[selector(c.GPU_STALL_IDLE_SECONDS, *who, f'gpu="{rank}"', f'cause="{cause}"')] = stalled
            spoke = (f'spoke="{SPOKE}"', *target)
            out[selector(c.SPOKE_HUB_FETCH_DURATION, *spoke, suffix="_count")] = self.counter(
                STEADY.hub_fetches, self.during.hub_fetches)
            out[selector(c.SPOKE_HUB_ERRORS, *spoke)] = self.counter(STEADY.hub_errors, self.during.hub_errors)
            out[selector(c.SPOKE_REQUESTS, *spoke, 'result="hit"')] = self.counter(STEADY.hits, self.during.hits)
            out[selector(c.SPOKE_REQUESTS, *spoke, 'result="miss"')] = self.counter(
                STEADY.hub_fetches, self.during.hub_errors)
            out[selector(c.SPOKE_HUB_PROBE_SUCCESS, *spoke)] = self.probe_success()
        return out


def deadline(alert: AlertRule) -> int:
    return CUT + round(duration_seconds(alert.for_)) + RATE_WINDOW + 30


def alerts(alert: AlertRule, state: str = "") -> str:
    """The ALERTS series of this alert, in `state` (pending or firing) if given."""
    matchers = [f'alertname="{alert.name}"', *([f'alertstate="{state}"'] if state else [])]
    return f"ALERTS{{{', '.join(matchers)}}}"


def check(expr: str, at: int, alert: AlertRule | None = None, state: str = "", name: bool = True) -> dict[str, object]:
    """`expr` at `at` seconds gives the alert's one sample in `state`, or nothing when `alert` is None."""
    if alert is None:
        return {"expr": expr, "eval_time": f"{at}s", "exp_samples": []}
    labels = {**({"__name__": "ALERTS"} if name else {}), "alertname": alert.name, "alertstate": state,
              **KEYS[alert.name], "severity": alert.severity, "component": COMPONENT}
    rendered = "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    return {"expr": expr, "eval_time": f"{at}s", "exp_samples": [{"labels": rendered, "value": 1}]}


def checks(run: Run, alert: AlertRule) -> list[dict[str, object]]:
    last_in_outage = run.end - run.end % round(duration_seconds(EVALUATION))
    fires_within = duration_seconds(alert.for_) < run.outage
    out = [
        check(alerts(alert), last_in_outage, alert, "firing" if fires_within else "pending"),
        check(f"max_over_time({alerts(alert, 'firing')}[{deadline(alert) - CUT}s])", deadline(alert), alert,
              "firing", name=False),
        check(alerts(alert), run.settled),
    ]
    if deadline(alert) <= run.end:
        out.append(check(alerts(alert), deadline(alert), alert, "firing"))
    return out


@pytest.mark.parametrize(("minutes", "during"), [(10, OUTAGE), (20, OUTAGE), (10, HANGING)],
                         ids=["10m outage", "20m outage", "10m outage, the hub answering nothing"])
def test_the_outage_alerts_fire_while_it_lasts_and_resolve_after(promtool: str, tmp_path: Path,
                                                                   minutes: int, during: Rates) -> None:
    run = Run(outage=minutes * 60, during=during)
    tests = tmp_path / "live.test.yaml"
    tests.write_text(yaml.safe_dump({
        "rule_files": RULE_FILES,
        "evaluation_interval": EVALUATION,
        "tests": [{
            "interval": SCRAPE,
            "input_series": [{"series": series, "values": values} for series, values in run.series().items()],
            "promql_expr_test": [item for alert in (STARVED, HUB_FAILING) for item in checks(run, alert)],
        }],
    }, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
