"""The agent's log: valid logfmt by default, JSON with `--log.format=json`, as the Prometheus exporters write."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable
from datetime import datetime

import pytest

from stallwatch.exporters.logformat import JsonFormatter, LogfmtFormatter
from stallwatch.harness import AgentProcess

KEYS = ["ts", "level", "caller", "logger", "msg"]
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)")
# A pair of logfmt: a key, and a bare value (no space, `=` or `"`) or a quoted one with backslash escapes.
PAIR = re.compile(r'([^\s="]+)=(?:"((?:[^"\\\x00-\x1f]|\\["\\nrt]|\\u[0-9a-f]{4})*)"|([^\s="\x00-\x1f]+))(?: |$)')
UNESCAPE = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\"}


def parse_logfmt(line: str) -> dict[str, str]:
    """One logfmt line, strictly: every character belongs to a pair, or it raises."""
    fields: dict[str, str] = {}
    at = 0
    while at < len(line):
        match = PAIR.match(line, at)
        if match is None:
            raise ValueError(f"not logfmt at column {at}: {line!r}")
        quoted, bare = match.group(2), match.group(3)
        fields[match.group(1)] = bare if quoted is None else re.sub(
            r"\\(u[0-9a-f]{4}|.)", lambda m: chr(int(m[1][1:], 16)) if len(m[1]) > 1 else UNESCAPE[m[1]], quoted)
        at = match.end()
    return fields


def check_fields(fields: dict[str, str]) -> None:
    assert list(fields)[:5] == KEYS, fields
    assert RFC3339.fullmatch(fields["ts"]) and datetime.fromisoformat(fields["ts"]).tzinfo is not None, fields
    assert fields["level"] in ("debug", "info", "warn", "error"), fields
    assert re.fullmatch(r"[\w.]+\.py:\d+", fields["caller"]), fields


@pytest.mark.parametrize("format_args", [[], ["--log.format", "logfmt"]])
def test_the_default_log_is_valid_logfmt(agent_factory: Callable[..., AgentProcess],
                                         format_args: list[str]) -> None:
    agent = agent_factory("--log.level", "debug", *format_args)  # no GPU here: a warn line too
    lines = agent.stderr().splitlines()
    parsed = [parse_logfmt(line) for line in lines]
    for fields in parsed:
        check_fields(fields)
    assert any(f["level"] == "warn" and "no GPU" in f["msg"] for f in parsed), lines
    listening = next(f for f in parsed if f["msg"].startswith("listening on "))
    assert listening["msg"] == f"listening on {agent.url}" and listening["logger"] == "stallwatch.agent"


def test_json_log_lines(agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--no-collector.gpu", "--log.format", "json")
    records = [json.loads(line) for line in agent.stderr().splitlines()]
    for record in records:
        check_fields(record)
    assert f"listening on {agent.url}" in [r["msg"] for r in records]


@pytest.mark.parametrize("message", ["plain", "", "a b", "k=v", 'say "hi"', "back\\slash", "two\nlines\ttab",
                                     "bell\x07", "naïve ünïcode"])
def test_logfmt_values_are_quoted_only_when_needed_and_round_trip(message: str) -> None:
    record = logging.LogRecord("stallwatch.x", logging.ERROR, "/src/x.py", 7, "%s", (message,), None)
    line = LogfmtFormatter().format(record)
    assert "\n" not in line
    fields = parse_logfmt(line)
    check_fields(fields)
    assert fields["msg"] == message and fields["level"] == "error" and fields["caller"] == "x.py:7"
    assert line.endswith(f"msg={message}") == bool(message and re.fullmatch(r'[^\s="\x00-\x1f]+', message))


def test_an_exception_is_one_more_field_on_the_same_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("stallwatch.x", logging.WARNING, "x.py", 1, "failed", (), sys.exc_info())
    for line, fields in [(text := LogfmtFormatter().format(record), parse_logfmt(text)),
                         (text := JsonFormatter().format(record), json.loads(text))]:
        assert "\n" not in line and fields["level"] == "warn" and fields["msg"] == "failed"
        assert fields["err"].startswith("Traceback") and fields["err"].endswith("RuntimeError: boom")
