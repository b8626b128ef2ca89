"""`--log.format`: the agent's log lines as the Prometheus exporters write them, logfmt or JSON.

    ts=2026-12-03T07:00:54.123Z level=info caller=agent.py:112 logger=stallwatch.agent msg="listening on ..."

`ts` is RFC 3339 in UTC, `level` is lower case (`warn` for Python's WARNING, as go-kit writes it), and a
logfmt value is quoted only when it must be (empty, or holding a space, `=`, `"` or a control character),
with logfmt's escapes. An exception is one more field, `err`, its traceback escaped onto the same line.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

FORMATS = ("logfmt", "json")
_LEVELS = {"WARNING": "warn", "CRITICAL": "error"}
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, str]:
    moment = datetime.fromtimestamp(record.created, UTC)
    fields = {
        "ts": moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z",
        "level": _LEVELS.get(record.levelname, record.levelname.lower()),
        "caller": f"{record.filename}:{record.lineno}",
        "logger": record.name,
        "msg": record.getMessage(),
    }
    if record.exc_info:
        fields["err"] = formatter.formatException(record.exc_info)
    return fields


def logfmt_value(value: str) -> str:
    if value and not any(c <= " " or c in '="' for c in value):
        return value
    escaped = "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if c < " " else c) for c in value)
    return f'"{escaped}"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={logfmt_value(value)}" for key, value in _fields(record, self).items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record, self), ensure_ascii=False, separators=(",", ":"))


def configure(level: int, log_format: str) -> None:
    """Send every log record to stderr, one line each in `log_format`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else LogfmtFormatter())
    logging.basicConfig(level=level, handlers=[handler])
