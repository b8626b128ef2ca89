"""The recording rules (`alerts/recording-rules.yaml`) that the alerts and cluster-wide views read.

Names follow `level:metric:operation`; rates are over `Thresholds.rate_window`.
"""

from __future__ import annotations

from stallwatch import catalogue as c
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.prometheus import RecordingRule, RuleGroup, render_rules
from stallwatch.mixin.promql import by, rate, selector

J = c.JOB_LABEL


def stall_rate_rule(t: Thresholds) -> RecordingRule:
    return RecordingRule(f"{J}_cause:{c.STALL_SECONDS.name.removesuffix('_total')}:rate{t.rate_window}",
                         by(f"{J}, cause", "sum", rate(c.STALL_SECONDS, t.rate_window)))


def gpu_stall_idle_rule(t: Thresholds) -> RecordingRule:
    return RecordingRule(f"{J}_cause:{c.GPU_STALL_IDLE_SECONDS.name.removesuffix('_total')}:rate{t.rate_window}",
                         by(f"{J}, cause", "sum", rate(c.GPU_STALL_IDLE_SECONDS, t.rate_window)))


def input_bound_rule(t: Thresholds) -> RecordingRule:
    return RecordingRule(f"{J}:{c.INPUT_BOUND_RATIO.name}:avg", by(J, "avg", selector(c.INPUT_BOUND_RATIO)))


def hit_ratio_rule(t: Thresholds) -> RecordingRule:
    hits = by("spoke", "sum", rate(c.SPOKE_REQUESTS, t.rate_window, 'result="hit"'))
    every = by("spoke", "sum", rate(c.SPOKE_REQUESTS, t.rate_window))
    name = c.SPOKE_REQUESTS.name.removesuffix("_total")
    return RecordingRule(f"spoke:{name}:hit_ratio_rate{t.rate_window}", f"{hits} / {every}")


def spoke_bytes_rule(t: Thresholds) -> RecordingRule:
    return RecordingRule(f"spoke_source:{c.SPOKE_BYTES.name.removesuffix('_total')}:rate{t.rate_window}",
                         by("spoke, source", "sum", rate(c.SPOKE_BYTES, t.rate_window)))


def recording_groups(t: Thresholds) -> tuple[RuleGroup, ...]:
    return (
        RuleGroup("stallwatch-training.recording", (stall_rate_rule(t), gpu_stall_idle_rule(t), input_bound_rule(t))),
        RuleGroup("stallwatch-spoke.recording", (hit_ratio_rule(t), spoke_bytes_rule(t))),
    )


def render_recording_rules(t: Thresholds | None = None) -> str:
    t = t or Thresholds()
    return render_rules(recording_groups(t), t.runbook_base_url, "stallwatch/mixin/rules.py")
