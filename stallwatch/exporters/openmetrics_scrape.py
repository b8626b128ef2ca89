"""Fetching a Prometheus/OpenMetrics endpoint, every failure a ScrapeError with a short reason (the `reason`
label of `stallwatch_spoke_collector_errors_total`); `openmetrics_mapping` parses what it needs of the body."""

from __future__ import annotations

import http.client
import ssl
from collections.abc import Callable, Mapping

from stallwatch import outbound

MAX_BODY_BYTES = 16 << 20


class ScrapeError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


HttpGet = Callable[[str, Mapping[str, str], float], bytes]


def http_get(url: str, headers: Mapping[str, str], timeout: float, context: ssl.SSLContext | None = None) -> bytes:
    """GET within one deadline of `timeout` seconds, a trickled answer included, and a size limit; every failure
    is a ScrapeError with a short reason. A redirect is one (`redirect`): it is not followed, so a token never
    reaches another host. TLS is verified against the system's CAs unless the caller passes another context."""
    try:
        reply = outbound.fetch(url, headers, outbound.Deadline(timeout), limit=MAX_BODY_BYTES, tls=context)
    except TimeoutError as error:
        raise ScrapeError("timeout", f"no complete answer from {url} within {timeout:g} s") from error
    except ssl.SSLError as error:
        raise ScrapeError("tls_error", f"{url}: {error}") from error
    except OSError as error:
        raise ScrapeError("unreachable", f"{url}: {error}") from error
    except http.client.HTTPException as error:
        raise ScrapeError("protocol", f"{url}: not an HTTP answer: {error!r}") from error
    except outbound.TooLargeError as error:
        raise ScrapeError("too_large", f"{url}: {error}") from error
    if 300 <= reply.status < 400:
        raise ScrapeError("redirect", f"HTTP {reply.status} from {url} to {reply.headers.get('Location')}, "
                                      "not followed: give the URL it names")
    if not 200 <= reply.status < 300:
        raise ScrapeError("http_error", f"HTTP {reply.status} from {url}")
    return reply.body

