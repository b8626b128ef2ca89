"""The recording rules (`alerts/recording-rules.yaml`) that the alerts and cluster-wide views read.

Names follow `level:metric:operation`; rates are over `Thresholds.rate_window`.

The correlator's series carry their window's end as sample timestamp but reach Prometheus only up to
`correlator_lag` later (config.py), stall seconds included: a stall's are booked as they accrue, on time,
but each sample is still stamped before it is scrapeable. A recording rule is evaluated once and keeps what
it found, so one evaluated now would find the newest `correlator_lag` of its window still empty and
under-count it for good, or record a gauge's value from before that lag as the value now. Every rule that
reads the correlator's series therefore reads them `correlator_lag` back (`offset`), once every sample it
reads is in; the recorded series lag the events by that. The spoke rules read series stamped at the scrape,
which are complete the moment they are scrapeable, and need no offset.
"""

from __future__ import annotations

from stallwatch import catalogue as c
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.prometheus import RecordingRule, RuleGroup, render_rules
from stallwatch.mixin.promql import by, rate

J = c.JOB_LABEL


def stall_rate_rule(t: Thresholds) -> RecordingRule:
    return RecordingRule(f"{J}_cause:{c.STALL_SECONDS.name.removesuffix('_total')}:rate{t.rate_window}",
                         by(f"{J}, cause", "sum", rate(c.STALL_SECONDS, t.rate_window, offset=t.correlator_lag)))


def gpu_stall_idle_rule(t: Thresholds) -> RecordingRule:
    return RecordingRule(f"{J}_cause:{c.GPU_STALL_IDLE_SECONDS.name.removesuffix('_total')}:rate{t.rate_window}",
                         by(f"{J}, cause", "sum",
                            rate(c.GPU_STALL_IDLE_SECONDS, t.rate_window, offset=t.correlator_lag)))


def input_bound_rule(t: Thresholds) -> RecordingRule:
    """The job's stall seconds over its stall plus compute seconds, summed over its ranks, over the rate window:
    the ratio the report's headline and the demo's lines give. (The per-rank gauge covers one window only:
    averaged, it swung between 0 and 1 with each burst of stalls, and the alert's `for` kept starting over.)"""
    stalled = by(J, "sum", rate(c.STALL_SECONDS, t.rate_window, offset=t.correlator_lag))
    computed = by(J, "sum", rate(c.COMPUTE_SECONDS, t.rate_window, offset=t.correlator_lag))
    return RecordingRule(f"{J}:{c.INPUT_BOUND_RATIO.name}:rate{t.rate_window}",
                         f"{stalled} / ({stalled} + {computed})")


def hit_ratio_rule(t: Thresholds) -> RecordingRule:
    hits = by("spoke", "sum", rate(c.SPOKE_REQUESTS, t.rate_window, 'result="hit"'))
    every = by("spoke", "sum", rate(c.SPOKE_REQUESTS, t.rate_window))
    name = c.SPOKE_REQUESTS.name.removesuffix("_total")
    return RecordingRule(f"spoke:{name}:hit_ratio_rate{t.rate_window}", f"{hits} / {every}")


def spoke_bytes_rule(t: Thresholds) -> RecordingRule:
    return RecordingRule(f"spoke_source:{c.SPOKE_BYTES.name.removesuffix('_total')}:rate{t.rate_window}",
                         by("spoke, source", "sum", rate(c.SPOKE_BYTES, t.rate_window)))


# The job-level view. In synchronous data-parallel training every rank waits in the step's collective
# for the slowest one, so a stall on one rank idles every GPU of the job. Each agent counts the time in
# which any of the job's ranks on its node stalled (the union in time: per step, the longest local wait).
# Per sub-window of `job_stall_window` the job's loss per GPU is taken as the largest of its nodes' shares
# (Prometheus evaluates every node's counters at the same wall-clock instants, so the windows line up
# across nodes); times the job's GPUs it is the GPU-seconds the job lost. The sum over nodes bounds it
# from above. docs/attribution.md gives the error bound.
JOB_KEY = f"cluster, {J}"  # a job's name is unique within its cluster
RANK_KEY = f"{JOB_KEY}, instance, node, rank"
STALL = c.STALL_SECONDS.name.removesuffix("_total")
JOB_STALL = c.JOB_STALL_SECONDS.name.removesuffix("_total")


def rank_cause_stall_rule(t: Thresholds) -> RecordingRule:
    return RecordingRule(f"{J}_node_rank_cause:{STALL}:rate{t.job_stall_window}",
                         by(f"{RANK_KEY}, cause", "sum",
                            rate(c.STALL_SECONDS, t.job_stall_window, offset=t.correlator_lag)))


def rank_stall_rule(t: Thresholds) -> RecordingRule:
    return RecordingRule(f"{J}_node_rank:{STALL}:rate{t.job_stall_window}",
                         by(RANK_KEY, "sum", rank_cause_stall_rule(t).record))


def node_stall_rule(t: Thresholds) -> RecordingRule:
    """Per node, the share of time some local rank of the job stalled: what that node's stalls cost each GPU
    of the job."""
    return RecordingRule(f"{J}_node:{JOB_STALL}:rate{t.job_stall_window}",
                         by(f"{JOB_KEY}, instance, node", "sum",
                            rate(c.JOB_STALL_SECONDS, t.job_stall_window, offset=t.correlator_lag)))


def job_stall_rule(t: Thresholds) -> RecordingRule:
    """The share of every GPU's time the job lost to input stalls: its worst node's (a lower bound)."""
    return RecordingRule(f"{J}:{JOB_STALL}:max_rate{t.job_stall_window}",
                         by(JOB_KEY, "max", node_stall_rule(t).record))


def job_stall_bound_rule(t: Thresholds) -> RecordingRule:
    """The upper bound of that share: the nodes' shares added up, as if their stalls never overlapped."""
    return RecordingRule(f"{J}:{JOB_STALL}:sum_rate{t.job_stall_window}",
                         f"clamp_max({by(JOB_KEY, 'sum', node_stall_rule(t).record)}, 1)")


def job_gpus_rule(t: Thresholds) -> RecordingRule:
    """The job's GPUs, one per rank reporting to an agent."""
    return RecordingRule(f"{J}:{c.PREFIX}ranks:count", by(JOB_KEY, "count", rank_stall_rule(t).record))


def job_stall_gpu_seconds_rule(t: Thresholds) -> RecordingRule:
    """GPU-seconds per second the job lost to input stalls, all its GPUs together."""
    return RecordingRule(f"{J}:{c.PREFIX}input_stall_gpu_seconds:rate{t.job_stall_window}",
                         f"{job_stall_rule(t).record} * on ({JOB_KEY}) {job_gpus_rule(t).record}")


def job_rules(t: Thresholds) -> tuple[RecordingRule, ...]:
    return (rank_cause_stall_rule(t), rank_stall_rule(t), node_stall_rule(t), job_stall_rule(t),
            job_stall_bound_rule(t), job_gpus_rule(t), job_stall_gpu_seconds_rule(t))


def recording_groups(t: Thresholds) -> tuple[RuleGroup, ...]:
    return (
        RuleGroup("stallwatch-training.recording", (stall_rate_rule(t), gpu_stall_idle_rule(t), input_bound_rule(t))),
        RuleGroup("stallwatch-job.recording", job_rules(t)),
        RuleGroup("stallwatch-spoke.recording", (hit_ratio_rule(t), spoke_bytes_rule(t))),
    )


def render_recording_rules(t: Thresholds | None = None) -> str:
    t = t or Thresholds()
    return render_rules(recording_groups(t), t.runbook_base_url, "stallwatch/mixin/rules.py")
