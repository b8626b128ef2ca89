"""The docs name only series that exist: the catalogue's metrics and the recording rules the mixin generates.

A rule's window (`rate1m`) is a setting (`Thresholds.job_stall_window`, a test's 10 s), so names are
compared with their window left out.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stallwatch import catalogue as c
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.prometheus import RecordingRule
from stallwatch.mixin.rules import recording_groups
from tests.conftest import ROOT

DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("clients/*/README.md")])
RULE = re.compile(r"(?<![\w:])([a-z_]+):(stallwatch_[a-z0-9_]+|…)(?::([a-z0-9_]+))?")
# A metric, or a family of them written as a prefix (`stallwatch_host_network_*`, `..._{a,b}_total`).
METRIC = re.compile(r"(?<![\w:])(stallwatch_[a-z0-9_]+)\b(?!-)([*{]?)")  # not a wheel: stallwatch_client-0.1.0
SAMPLE_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")
WINDOW = re.compile(r"rate\d+[smhdwy]")


def any_window(name: str) -> str:
    return WINDOW.sub("rate<window>", name)


RULES = {any_window(rule.record) for group in recording_groups(Thresholds()) for rule in group.rules
         if isinstance(rule, RecordingRule)}
LEVELS = {rule.split(":", 1)[0] for rule in RULES}
METRICS = {metric.name for metric in c.all_metrics()}


def unknown_names(text: str) -> list[str]:
    unknown = []
    for match in RULE.finditer(text):
        level, metric, operation = match.groups()
        if level not in LEVELS or (metric != "…" and operation and any_window(match.group()) not in RULES):
            unknown.append(match.group())
    for match in METRIC.finditer(text):
        name, family = match.groups()
        if text[match.end(1):].startswith(":"):
            continue  # the metric of a rule, checked above
        if family:
            known = any(metric.startswith(name) for metric in METRICS)
        else:
            known = name in METRICS or any(name.removesuffix(s) in METRICS for s in SAMPLE_SUFFIXES)
        if not known:
            unknown.append(name)
    return unknown


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_metric_and_recording_rule_a_doc_names_exists(doc: Path) -> None:
    assert unknown_names(doc.read_text()) == []


def test_the_check_finds_names_that_do_not_exist() -> None:
    text = ("`job:stallwatch_job_stall_seconds:max_rate1m`, `job_node:…`, `stallwatch_gpu_idle_ratio`, "
            "`stallwatch_hub_*`, but `training_job:stallwatch_job_stall_seconds:max_rate10s`, "
            "`stallwatch_stall_seconds_total`, `stallwatch_host_network_*`")
    assert unknown_names(text) == ["job:stallwatch_job_stall_seconds:max_rate1m", "job_node:…",
                                   "stallwatch_gpu_idle_ratio", "stallwatch_hub_"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_a_count_of_causes_is_the_catalogues(doc: Path) -> None:
    counts = {int(n) for n in re.findall(r"by cause \((\d+)\)", doc.read_text())}
    assert counts <= {len(c.CAUSES)}
