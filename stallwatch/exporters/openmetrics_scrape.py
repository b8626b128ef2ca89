"""Fetching and parsing a Prometheus/OpenMetrics endpoint, every failure a ScrapeError with a short reason
(the `reason` label of `stallwatch_spoke_collector_errors_total`)."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

MAX_BODY_BYTES = 16 << 20


class ScrapeError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


HttpGet = Callable[[str, Mapping[str, str], float], bytes]


def http_get(url: str, headers: Mapping[str, str], timeout: float, context: ssl.SSLContext | None = None) -> bytes:
    """GET with a timeout and a size limit; every failure is a ScrapeError with a short reason.
    TLS is verified against the system's CAs unless the caller passes another context."""
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            body: bytes = response.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as error:
        raise ScrapeError("http_error", f"HTTP {error.code} from {url}") from error
    except TimeoutError as error:
        raise ScrapeError("timeout", f"no answer from {url} within {timeout} s") from error
    except urllib.error.URLError as error:
        if isinstance(error.reason, TimeoutError):
            raise ScrapeError("timeout", f"no answer from {url} within {timeout} s") from error
        if isinstance(error.reason, ssl.SSLError):
            raise ScrapeError("tls_error", f"{url}: {error.reason}") from error
        raise ScrapeError("unreachable", f"{url}: {error.reason}") from error
    except OSError as error:
        raise ScrapeError("unreachable", f"{url}: {error}") from error
    if len(body) > MAX_BODY_BYTES:
        raise ScrapeError("too_large", f"{url}: more than {MAX_BODY_BYTES} bytes")
    return body


def parse_exposition(body: bytes) -> list[Metric]:
    try:
        return list(text_string_to_metric_families(body.decode("utf-8")))
    except (ValueError, UnicodeDecodeError, IndexError, TypeError) as error:
        raise ScrapeError("parse_error", f"not Prometheus text: {error}") from error
