"""The generated rules, checked and unit-tested by the real promtool: every alert fires once and stays quiet once.

The cases are data: input series in promtool's expanding notation, when to evaluate, and which alerts
(labels and expanded description) must be firing then; an empty expectation means the alert must not fire.
They run against the committed `alerts/*.yaml` (test_generate keeps those equal to a fresh render).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from stallwatch import catalogue as c
from stallwatch.mixin.alerts import all_alerts, render_alerting_rules
from stallwatch.mixin.config import COMPONENT, Thresholds
from stallwatch.mixin.generate import ARTIFACTS
from tests.conftest import ROOT

RULE_FILES = sorted(ROOT / path for path in ARTIFACTS if path.startswith("alerts/"))
ALERTS = {alert.name: alert for alert in all_alerts(Thresholds())}
N1 = 'instance="n1"'
NODE_A, NODE_B = 'instance="a:9842", node="a"', 'instance="b:9842", node="b"'


@dataclass(frozen=True)
class Case:
    alert: str
    series: dict[str, str]
    at: str
    firing: tuple[tuple[dict[str, str], str], ...] = ()  # (labels without severity, description); () = quiet
    interval: str = "1m"  # between two input samples


def s(metric: c.AnyMetricDef, *labels: str, suffix: str = "") -> str:
    return f"{metric.name}{suffix}{{{', '.join(labels)}}}"


def bursts(odd: float, even: float, minutes: int = 40) -> str:
    """A counter's values a minute apart, rising by `odd` in odd minutes and by `even` in even ones."""
    total, values = 0.0, ["0"]
    for minute in range(1, minutes + 1):
        total += odd if minute % 2 else even
        values.append(f"{total:g}")
    return " ".join(values)


CASES = (
    Case("StallwatchGPUsStarvedByRemoteFetches", {
        s(c.GPU_STALL_IDLE_SECONDS, 'training_job="train"', N1, 'gpu="0"', 'cause="remote_fetch"'): "0+18x30",
        s(c.GPU_STALL_IDLE_SECONDS, 'training_job="train"', N1, 'gpu="0"', 'cause="cache_read"'): "0+30x30",
        s(c.GPU_STALL_IDLE_SECONDS, 'training_job="train"', N1, 'gpu="1"', 'cause="remote_fetch"'): "0+6x30",
    }, "20m", (({"training_job": "train"}, "GPUs of job train spent 20% of their time idle during stalls attributed to "
                                 "remote fetches from the hub."),)),
    Case("StallwatchGPUsStarvedByRemoteFetches", {  # idle mostly on cache reads: not the hub's fault
        s(c.GPU_STALL_IDLE_SECONDS, 'training_job="train"', N1, 'gpu="0"', 'cause="remote_fetch"'): "0+3x30",
        s(c.GPU_STALL_IDLE_SECONDS, 'training_job="train"', N1, 'gpu="0"', 'cause="cache_read"'): "0+40x30",
    }, "20m"),
    Case("StallwatchTrainingInputBound", {  # stall over stall plus compute, both ranks: 36 s of every 120
        s(c.STALL_SECONDS, 'training_job="train"', N1, 'rank="0"', 'cause="remote_fetch"'): "0+15x30",
        s(c.COMPUTE_SECONDS, 'training_job="train"', N1, 'rank="0"'): "0+45x30",
        s(c.STALL_SECONDS, 'training_job="train"', N1, 'rank="1"', 'cause="preprocess"'): "0+21x30",
        s(c.COMPUTE_SECONDS, 'training_job="train"', N1, 'rank="1"'): "0+39x30",
    }, "20m", (({"training_job": "train"}, "Job train waits for input 30% of its step time (highly input-bound)."),)),
    Case("StallwatchTrainingInputBound", {  # bursts of stalls every other minute: each window's ratio swings
        # between 0 and 0.6 (averaged, it kept the alert's `for` starting over), the job's over 5 minutes holds
        s(c.STALL_SECONDS, 'training_job="train"', N1, 'rank="0"', 'cause="remote_fetch"'): bursts(36, 0),
        s(c.COMPUTE_SECONDS, 'training_job="train"', N1, 'rank="0"'): bursts(24, 60),
    }, "20m", (({"training_job": "train"}, "Job train waits for input 30% of its step time (highly input-bound)."),)),
    Case("StallwatchTrainingInputBound", {  # moderately input-bound only: 20 s of every 120
        s(c.STALL_SECONDS, 'training_job="train"', N1, 'rank="0"', 'cause="remote_fetch"'): "0+9x30",
        s(c.COMPUTE_SECONDS, 'training_job="train"', N1, 'rank="0"'): "0+51x30",
        s(c.STALL_SECONDS, 'training_job="train"', N1, 'rank="1"', 'cause="remote_fetch"'): "0+11x30",
        s(c.COMPUTE_SECONDS, 'training_job="train"', N1, 'rank="1"'): "0+49x30",
    }, "20m"),
    Case("StallwatchWarmupOverBudget", {
        s(c.WARMUP_PHASE, 'training_job="train"', N1, 'phase="cold"'): "1x10 0x30",
        s(c.WARMUP_PHASE, 'training_job="train"', N1, 'phase="transition"'): "0x10 1x30",
        s(c.WARMUP_PHASE, 'training_job="train"', N1, 'phase="steady"'): "0x40",
    }, "35m", (({"training_job": "train"}, "Job train has not reached steady state within 30m."),)),
    Case("StallwatchWarmupOverBudget", {  # steady after 20 minutes, within the budget
        s(c.WARMUP_PHASE, 'training_job="train"', N1, 'phase="cold"'): "1x10 0x30",
        s(c.WARMUP_PHASE, 'training_job="train"', N1, 'phase="transition"'): "0x10 1x10 0x20",
        s(c.WARMUP_PHASE, 'training_job="train"', N1, 'phase="steady"'): "0x20 1x20",
    }, "35m"),
    # The job rules read the correlator's counters `correlator_lag` back, over `job_stall_window` (1m): their
    # input is sampled every 15 s, as the agents are scraped, so that window always holds several samples.
    Case("StallwatchNodeStallsCostJob", {
        # Node b's rank 2 waits for remote fetches 30 % of its time; every GPU of the job waits with it.
        s(c.STALL_SECONDS, 'training_job="train"', NODE_A, 'rank="0"', 'cause="preprocess"'): "0+0.075x120",
        s(c.STALL_SECONDS, 'training_job="train"', NODE_A, 'rank="1"', 'cause="preprocess"'): "0+0.15x120",
        s(c.STALL_SECONDS, 'training_job="train"', NODE_B, 'rank="2"', 'cause="remote_fetch"'): "0+3.75x120",
        s(c.STALL_SECONDS, 'training_job="train"', NODE_B, 'rank="2"', 'cause="other"'): "0+0.75x120",
        s(c.STALL_SECONDS, 'training_job="train"', NODE_B, 'rank="3"', 'cause="remote_fetch"'): "0+0.75x120",
        s(c.JOB_STALL_SECONDS, 'training_job="train"', NODE_A): "0+0.15x120",
        s(c.JOB_STALL_SECONDS, 'training_job="train"', NODE_B): "0+4.5x120",
    }, "20m", (({"training_job": "train", "instance": "b:9842", "node": "b"},
                "Input stalls on node b cost job train 30% of its GPU time: all of its GPUs wait for that node's "
                "slowest rank."),), interval="15s"),
    Case("StallwatchNodeStallsCostJob", {
        # Each node's ranks stall 6 % of the time: under the threshold, though the two nodes' sum is over it;
        # node b's 30 % lasted 5 minutes, shorter than the alert's `for`.
        s(c.JOB_STALL_SECONDS, 'training_job="train"', NODE_A): "0+0.9x120",
        s(c.JOB_STALL_SECONDS, 'training_job="train"', NODE_B): "0+0.9x56 50.4+4.5x20 140.4+0.9x40",
    }, "20m", interval="15s"),
    Case("StallwatchSpokeHitRatioRegressed", {  # 90 % for an hour, then 50 %
        s(c.SPOKE_REQUESTS, 'spoke="s1"', N1, 'result="hit"'): "0+90x60 5450+50x60",
        s(c.SPOKE_REQUESTS, 'spoke="s1"', N1, 'result="miss"'): "0+10x60 610+50x60",
    }, "90m", (({"spoke": "s1"}, "Spoke s1 serves only 50% of requests from cache, 15% or more below its best of "
                                 "the last 6h."),)),
    Case("StallwatchSpokeHitRatioRegressed", {
        # s1 slips from 90 % to 80 %: within the allowed drop; s2 never warmed up (60 % to 30 %).
        s(c.SPOKE_REQUESTS, 'spoke="s1"', N1, 'result="hit"'): "0+90x60 5480+80x60",
        s(c.SPOKE_REQUESTS, 'spoke="s1"', N1, 'result="miss"'): "0+10x60 620+20x60",
        s(c.SPOKE_REQUESTS, 'spoke="s2"', N1, 'result="hit"'): "0+60x60 3630+30x60",
        s(c.SPOKE_REQUESTS, 'spoke="s2"', N1, 'result="miss"'): "0+40x60 2470+70x60",
    }, "90m"),
    Case("StallwatchSpokeHitRatioRegressed", {
        # 90 % for an hour, then 50 %: the hub fails, and four in five of its fetches end in errors. The cache lost
        # nothing; the failing-hub alert says what happened.
        s(c.SPOKE_REQUESTS, 'spoke="s1"', N1, 'result="hit"'): "0+90x60 5450+50x60",
        s(c.SPOKE_REQUESTS, 'spoke="s1"', N1, 'result="miss"'): "0+10x60 610+50x60",
        s(c.SPOKE_HUB_ERRORS, 'spoke="s1"', N1): "0x60 0+40x60",
        s(c.SPOKE_HUB_FETCH_DURATION, 'spoke="s1"', N1, suffix="_count"): "0+10x60 610+50x60",
    }, "90m"),
    Case("StallwatchHubFailingWhileTrainingStalls", {
        s(c.SPOKE_HUB_ERRORS, 'spoke="s1"', N1): "0+30x20",
        s(c.SPOKE_HUB_FETCH_DURATION, 'spoke="s1"', N1, suffix="_count"): "0+30x20",
        s(c.STALL_SECONDS, 'training_job="train"', N1, 'rank="0"', 'cause="remote_fetch"'): "0+30x20",
    }, "15m", (({"spoke": "s1"}, "Spoke s1: 50% of fetches from the hub (or of the nodes' probes of it) fail "
                                 "while training ranks reading through it stall."),)),
    Case("StallwatchHubFailingWhileTrainingStalls", {
        # The hub accepts connections and answers nothing: no fetch ends, so none fails yet, but n1's probes of it
        # time out (from minute 3 on), and n1's rank waits on its misses.
        s(c.SPOKE_HUB_FETCH_DURATION, 'spoke="s1"', N1, suffix="_count"): "0+30x2 90x17",
        s(c.SPOKE_HUB_PROBE_SUCCESS, 'spoke="s1"', N1): "1x2 0x17",
        s(c.STALL_SECONDS, 'training_job="train"', N1, 'rank="0"', 'cause="remote_fetch"'): "0+1x2 2+60x17",
    }, "15m", (({"spoke": "s1"}, "Spoke s1: 100% of fetches from the hub (or of the nodes' probes of it) fail "
                                 "while training ranks reading through it stall."),)),
    Case("StallwatchHubFailingWhileTrainingStalls", {
        # A probe in three fails (a lossy link) and no fetch does: the hub still serves, whoever stalls.
        s(c.SPOKE_HUB_FETCH_DURATION, 'spoke="s1"', N1, suffix="_count"): "0+30x20",
        s(c.SPOKE_HUB_PROBE_SUCCESS, 'spoke="s1"', N1): " ".join(["1 1 0"] * 7),
        s(c.STALL_SECONDS, 'training_job="train"', N1, 'rank="0"', 'cause="remote_fetch"'): "0+60x20",
    }, "15m"),
    Case("StallwatchHubFailingWhileTrainingStalls", {  # the hub fails but nobody stalls on it
        s(c.SPOKE_HUB_ERRORS, 'spoke="s1"', N1): "0+30x20",
        s(c.SPOKE_HUB_FETCH_DURATION, 'spoke="s1"', N1, suffix="_count"): "0+30x20",
        s(c.STALL_SECONDS, 'training_job="train"', N1, 'rank="0"', 'cause="remote_fetch"'): "0x20",
    }, "15m"),
    Case("StallwatchHubFailingWhileTrainingStalls", {
        # s1's hub fails; the job that stalls hard runs on n2, which reads through s2 (its hub probe says so);
        # on n1, which reads through s1, a rank stalls 1 % of its time (the 1 ms stall threshold's noise).
        s(c.SPOKE_HUB_ERRORS, 'spoke="s1"', N1): "0+30x20",
        s(c.SPOKE_HUB_FETCH_DURATION, 'spoke="s1"', N1, suffix="_count"): "0+30x20",
        s(c.STALL_SECONDS, 'training_job="small"', N1, 'rank="0"', 'cause="other"'): "0+0.6x20",
        s(c.SPOKE_HUB_PROBE_SUCCESS, 'spoke="s2"', 'instance="n2"'): "1x20",
        s(c.STALL_SECONDS, 'training_job="train"', 'instance="n2"', 'rank="0"', 'cause="remote_fetch"'): "0+40x20",
    }, "15m"),
    Case("StallwatchEgressOverBudget", {  # 6 GB a minute: 360 GB an hour at 0.02 USD/GB
        s(c.SPOKE_BYTES, 'spoke="s1"', N1, 'source="hub"'): "0+6000000000x100",
    }, "80m", (({}, "Spokes fetched 7.20 USD of data from the hub in the last hour (budget 5.0 USD per hour at "
                    "0.02 USD/GB)."),)),
    Case("StallwatchEgressOverBudget", {  # 4 GB a minute from the hub: 4.80 USD an hour; cache bytes are free
        s(c.SPOKE_BYTES, 'spoke="s1"', N1, 'source="hub"'): "0+4000000000x100",
        s(c.SPOKE_BYTES, 'spoke="s1"', N1, 'source="cache"'): "0+90000000000x100",
    }, "80m"),
    Case("StallwatchClientDroppingEvents", {
        s(c.CLIENT_DROPPED_EVENTS, 'training_job="train"', 'rank="0"', N1): "0+60x20",
        s(c.RECEIVER_EVENTS, 'kind="wait"', N1): "0+540x20",
        # n2 accepts nothing
        s(c.CLIENT_DROPPED_EVENTS, 'training_job="train"', 'rank="0"', 'instance="n2"'): "0+60x20",
    }, "15m", (
        ({"instance": "n1"}, "Training clients on n1 dropped 10% of their events: stall attribution there is "
                             "incomplete."),
        ({"instance": "n2"}, "Training clients on n2 dropped 100% of their events: stall attribution there is "
                             "incomplete."),
    )),
    Case("StallwatchClientDroppingEvents", {
        s(c.CLIENT_DROPPED_EVENTS, 'training_job="train"', 'rank="0"', N1): "0+3x20",
        s(c.RECEIVER_EVENTS, 'kind="wait"', N1): "0+597x20",
    }, "15m"),
    Case("StallwatchReceiverDroppingEvents", {
        s(c.RECEIVER_DROPPED_EVENTS, 'reason="queue_full"', N1): "0+60x20",
        s(c.RECEIVER_EVENTS, 'kind="wait"', N1): "0+540x20",
    }, "15m", (({"instance": "n1"}, "The agent on n1 dropped 10% of the events it received (queue full or "
                                    "rejected batches)."),)),
    Case("StallwatchReceiverDroppingEvents", {
        s(c.RECEIVER_DROPPED_EVENTS, 'reason="queue_full"', N1): "0+3x20",
        s(c.RECEIVER_EVENTS, 'kind="wait"', N1): "0+597x20",
    }, "15m"),
    Case("StallwatchAgentDown", {'up{job="stallwatch", instance="n1:9842"}': "0x10"}, "6m",
         (({"job": "stallwatch", "instance": "n1:9842"}, "The stallwatch agent at n1:9842 has been unreachable "
                                                         "for 5m."),)),
    Case("StallwatchAgentDown", {  # another job's target is down, not the agent's
        'up{job="stallwatch", instance="n1:9842"}': "1x10",
        'up{job="other", instance="n1:9100"}': "0x10",
    }, "6m"),
    Case("StallwatchCollectorFailing", {s(c.SCRAPE_COLLECTOR_SUCCESS, 'collector="gpu"', N1): "0x15"}, "12m",
         (({"instance": "n1", "collector": "gpu"}, "Collector gpu on n1 fails (for `gpu`: NVML)."),)),
    Case("StallwatchCollectorFailing", {  # failed twice, recovered
        s(c.SCRAPE_COLLECTOR_SUCCESS, 'collector="gpu"', N1): "1 1 0 0 1x12",
    }, "14m"),
    Case("StallwatchGPUsUnreachable", {  # GPU 1 lost at minute 5
        s(c.GPU_DEVICES, N1): "2x30",
        s(c.GPU_UP, N1, 'gpu="0"'): "1x30",
        s(c.GPU_UP, N1, 'gpu="1"'): "1x4 0x26",
    }, "17m", (({"instance": "n1"}, "1 GPUs on n1 do not answer NVML (a GPU lost, or the driver gone)."),)),
    Case("StallwatchGPUsUnreachable", {  # the driver goes at minute 5: no GPU left where there were 2
        s(c.GPU_DEVICES, N1): "2x4 0x26",
        s(c.GPU_UP, N1, 'gpu="0"'): "1x4 _x26",
        s(c.GPU_UP, N1, 'gpu="1"'): "1x4 _x26",
    }, "17m", (({"instance": "n1"}, "2 GPUs on n1 do not answer NVML (a GPU lost, or the driver gone)."),)),
    Case("StallwatchGPUsUnreachable", {  # a node without GPUs, and one whose 2 GPUs answer
        s(c.GPU_DEVICES, N1): "0x30",
        s(c.GPU_DEVICES, 'instance="n2"'): "2x30",
        s(c.GPU_UP, 'instance="n2"', 'gpu="0"'): "1x30",
        s(c.GPU_UP, 'instance="n2"', 'gpu="1"'): "1x30",
    }, "17m"),
    Case("StallwatchGPUsUnreachable", {  # GPU 1 taken out on purpose at minute 5: quiet at once, not for an hour
        s(c.GPU_DEVICES, N1): "2x4 1x26",
        s(c.GPU_UP, N1, 'gpu="0"'): "1x30",
        s(c.GPU_UP, N1, 'gpu="1"'): "1x4 _x26",
    }, "17m"),
    Case("StallwatchGPUXidErrors", {s(c.GPU_XID_ERRORS, N1, 'gpu="0"', 'xid="79"'): "0 0 0 1x10"}, "12m",
         (({"instance": "n1", "gpu": "0", "xid": "79"}, "GPU 0 on n1 reported XID 79, a hardware or driver fault: "
                                                        "1 in the last 10m."),)),
    Case("StallwatchGPUXidErrors", {  # an old count that does not grow: no sticky alert
        s(c.GPU_XID_ERRORS, N1, 'gpu="0"', 'xid="79"'): "3x20",
    }, "12m"),
    Case("StallwatchGPUXidErrors", {  # the application's XIDs (and deferrable ones) never page
        s(c.GPU_XID_ERRORS, N1, 'gpu="0"', f'xid="{xid}"'): "0 0 0 1+1x10" for xid in (13, 31, 43, 45, 63, 92, 94)
    }, "12m"),
    Case("StallwatchGPUXidWarnings", {s(c.GPU_XID_ERRORS, N1, 'gpu="1"', 'xid="13"'): "0 0 0 2x10"}, "12m",
         (({"instance": "n1", "gpu": "1", "xid": "13"}, "GPU 1 on n1 reported XID 13: 2 in the last 10m."),)),
    Case("StallwatchGPUXidWarnings", {  # a hardware XID is the critical alert's, not also a warning
        s(c.GPU_XID_ERRORS, N1, 'gpu="0"', 'xid="79"'): "0 0 0 1x10",
        s(c.GPU_XID_ERRORS, N1, 'gpu="1"', 'xid="13"'): "3x20",
    }, "12m"),
)


def promtool_test(case: Case) -> dict[str, object]:
    alert = ALERTS[case.alert]
    expected = [
        {
            "exp_labels": {**labels, "severity": alert.severity, "component": COMPONENT},
            "exp_annotations": {
                "summary": alert.summary,
                "description": description,
                "runbook_url": f"{Thresholds().runbook_base_url}#{alert.anchor}",
            },
        }
        for labels, description in case.firing
    ]
    return {
        "interval": case.interval,
        "input_series": [{"series": series, "values": values} for series, values in case.series.items()],
        "alert_rule_test": [{"eval_time": case.at, "alertname": case.alert, "exp_alerts": expected}],
    }


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    fires = {case.alert for case in CASES if case.firing}
    quiet = {case.alert for case in CASES if not case.firing}
    assert set(ALERTS) == fires == quiet
    assert set(ALERTS) >= {case.alert for case in CASES}


def test_promtool_checks_every_rule_file(promtool: str) -> None:
    assert [p.name for p in RULE_FILES] == ["alerting-rules.yaml", "recording-rules.yaml"]
    result = subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_recording_rules_follow_level_metric_operation() -> None:
    groups = yaml.safe_load((ROOT / "alerts/recording-rules.yaml").read_text())["groups"]
    names = [rule["record"] for group in groups for rule in group["rules"]]
    assert names and all(len(name.split(":")) == 3 and all(name.split(":")) for name in names), names



def test_every_recording_rule_reads_the_correlators_series_its_lag_back() -> None:
    # A correlator sample is stamped before it is scrapeable, and a recording rule is evaluated once: read
    # without the lag, the newest part of its window is missing from the recorded series for good (a 5 min
    # input-bound average once recorded 0.014 where the gauge read 1.0). The spoke's series are stamped at
    # the scrape and need none.
    lag = Thresholds().correlator_lag
    groups = yaml.safe_load((ROOT / "alerts/recording-rules.yaml").read_text())["groups"]
    reads = [(rule["record"], metric.name, rule["expr"]) for group in groups for rule in group["rules"]
             for metric in c.by_subsystem("correlator") if metric.name in rule["expr"]]
    assert {record for record, _, _ in reads} >= {f"{c.JOB_LABEL}:{c.INPUT_BOUND_RATIO.name}:rate5m"}
    for record, name, expr in reads:
        bare = rf"(?<![\w:]){name}(?![\w:])"  # the metric, not a record named after it
        lagged = re.findall(rf"{bare}(?:{{[^}}]*}})?(?:\[\w+\])? offset {lag}\b", expr)
        every = re.findall(bare, expr)
        assert len(every) == len(lagged), f"{record} reads {name} without `offset {lag}`: {expr}"

@pytest.mark.parametrize("firing", [True, False], ids=["fires", "quiet"])
def test_promtool_unit_tests(promtool: str, tmp_path: Path, firing: bool) -> None:
    tests = tmp_path / "stallwatch.test.yaml"
    tests.write_text(yaml.safe_dump({
        "rule_files": [str(p) for p in RULE_FILES],
        "evaluation_interval": "1m",
        "tests": [promtool_test(case) for case in CASES if bool(case.firing) is firing],
    }, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_quiet_case_would_catch_a_rule_that_always_fires(promtool: str, tmp_path: Path) -> None:
    # The quiet cases must be able to fail: the same test run against a rule with its condition removed fails.
    broken = tmp_path / "alerting-rules.yaml"
    document = yaml.safe_load((ROOT / "alerts/alerting-rules.yaml").read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == "StallwatchAgentDown":
                rule["expr"] = 'up{job="stallwatch"}'
    broken.write_text(yaml.safe_dump(document))
    quiet = next(case for case in CASES if case.alert == "StallwatchAgentDown" and not case.firing)
    tests = tmp_path / "broken.test.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [str(broken)], "evaluation_interval": "1m",
                                     "tests": [promtool_test(quiet)]}))
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "StallwatchAgentDown" in result.stdout + result.stderr


def test_every_alert_carries_what_the_conventions_ask() -> None:
    runbooks = (ROOT / "docs/runbooks.md").read_text()
    for group in yaml.safe_load((ROOT / "alerts/alerting-rules.yaml").read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["alert"].startswith("Stallwatch") and rule["for"]
            assert rule["labels"]["severity"] in ("critical", "warning")
            assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
            anchor = rule["annotations"]["runbook_url"].split("#")[1]
            assert f"\n## {rule['alert']}\n" in runbooks and anchor == rule["alert"].lower()


def test_thresholds_shape_the_rules_and_refuse_nonsense() -> None:
    strict = render_alerting_rules(Thresholds(input_bound_ratio=0.3, input_bound_for="1h"))
    rule = next(r for g in yaml.safe_load(strict)["groups"] for r in g["rules"]
                if r["alert"] == "StallwatchTrainingInputBound")
    assert rule["expr"].endswith(">= 0.3") and rule["for"] == "1h"
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        Thresholds(warmup_budget="half an hour")
    with pytest.raises(ValueError, match="not a ratio"):
        Thresholds(hub_error_ratio=5)
