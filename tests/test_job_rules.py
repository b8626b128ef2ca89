"""The job-level recording rules under the real promtool: a multi-node job's input-stall cost across all its
GPUs is its slowest rank's stall share times its GPUs, and the gating node, rank and cause are found."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from stallwatch import catalogue as c
from stallwatch.mixin import rules
from stallwatch.mixin.config import Thresholds, duration_seconds
from tests.conftest import ROOT

T = Thresholds()
A, B = 'instance="a:9842", node="a"', 'instance="b:9842", node="b"'


def stall(node: str, rank: int, cause: str) -> str:
    return f'{c.STALL_SECONDS.name}{{{c.JOB_LABEL}="train", {node}, rank="{rank}", cause="{cause}"}}'


# Per minute: node a's ranks stall 5 % and 10 % (preprocessing); node b's rank 2 stalls 30 % (25 % remote
# fetches, 5 % other), its rank 3 5 %.
SERIES = {
    stall(A, 0, "preprocess"): "0+3x30",
    stall(A, 1, "preprocess"): "0+6x30",
    stall(B, 2, "remote_fetch"): "0+15x30",
    stall(B, 2, "other"): "0+3x30",
    stall(B, 3, "remote_fetch"): "0+3x30",
    # the time in which some rank of the job on the node stalled: node b's ranks stall at the same time
    f'{c.JOB_STALL_SECONDS.name}{{{c.JOB_LABEL}="train", {A}}}': "0+7.5x30",
    f'{c.JOB_STALL_SECONDS.name}{{{c.JOB_LABEL}="train", {B}}}': "0+18x30",
}
JOB = {c.JOB_LABEL: "train"}
NODE_B = {**JOB, "instance": "b:9842", "node": "b"}


# The rules read the correlator's series `correlator_lag` back (their samples arrive that late): evaluated
# then, they give the rates over the minute from 19m to 20m, two samples apart. Evaluated every second, so
# that instant is an evaluation's whatever the lag.
AT = f"{20 * 60 + round(duration_seconds(T.correlator_lag))}s"


def expect(expr: str, *samples: tuple[dict[str, str], float]) -> dict[str, object]:
    """`expr` evaluated at AT gives these samples; a plain series name comes back with its __name__."""
    name = {"__name__": expr} if expr.replace(":", "_").isidentifier() else {}
    return {"expr": expr, "eval_time": AT, "exp_samples": [
        {"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in {**name, **labels}.items()) + "}", "value": value}
        for labels, value in samples]}


def test_job_cost_is_the_slowest_rank_times_the_jobs_gpus_and_the_gate_is_found(promtool: str,
                                                                                   tmp_path: Path) -> None:
    rank = rules.rank_stall_rule(T).record
    gating = (f"{rules.rank_cause_stall_rule(T).record} and on (cluster, {c.JOB_LABEL}, instance, node, rank) "
              f"topk by (cluster, {c.JOB_LABEL}) (1, {rank})")
    gate = {"__name__": rules.rank_cause_stall_rule(T).record, **NODE_B, "rank": "2"}
    tests = tmp_path / "job.test.yaml"
    tests.write_text(yaml.safe_dump({
        "rule_files": [str(ROOT / "alerts/recording-rules.yaml")],
        "evaluation_interval": "1s",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": series, "values": values} for series, values in SERIES.items()],
            "promql_expr_test": [
                expect(rules.job_gpus_rule(T).record, (JOB, 4)),
                expect(rules.job_stall_rule(T).record, (JOB, 0.3)),
                expect(rules.job_stall_gpu_seconds_rule(T).record, (JOB, 1.2)),  # 4 GPUs x 30 %
                expect(rules.node_stall_rule(T).record, ({**JOB, "instance": "a:9842", "node": "a"}, 0.125),
                       (NODE_B, 0.3)),
                expect(rules.job_stall_bound_rule(T).record, (JOB, 0.425)),
                expect(gating, ({**gate, "cause": "other"}, 0.05), ({**gate, "cause": "remote_fetch"}, 0.25)),
            ],
        }],
    }, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
