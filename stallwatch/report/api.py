"""Prometheus's HTTP API as the report asks it, through basic auth or a bearer token and TLS.

Secrets come from files only (a password on the command line is in every `ps` listing and shell history).
Every failure is a `PrometheusError` with one line that says what to change. Each query has one deadline
(`timeout`) over connect, answer and body, and its answer a size limit (`MAX_ANSWER_BYTES`); a redirect is
not followed, so the credentials never reach another host (or the same over plain http): the error names
the URL to give instead.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stallwatch import outbound
from stallwatch.report.run import Series

Labels = dict[str, str]
MAX_ANSWER_BYTES = 256 << 20  # the report's answers are a few MiB; more is a mistaken scope, not data to hold


class PrometheusError(RuntimeError):
    """Prometheus could not be asked, or refused: the message is the one line to print."""


def _secret(path: Path, what: str) -> str:
    try:
        secret = path.read_text().strip()  # as Prometheus reads its own password and token files
    except OSError as error:
        raise PrometheusError(f"cannot read the {what} file {path}: {error.strerror}") from error
    if not secret:
        raise PrometheusError(f"the {what} file {path} is empty")
    return secret


@dataclass(frozen=True)
class Access:
    """How to reach a Prometheus: credentials (one kind at most) and how to trust its certificate."""

    basic_auth_user: str | None = None
    basic_auth_password_file: Path | None = None
    bearer_token_file: Path | None = None
    ca_file: Path | None = None
    insecure_skip_tls_verify: bool = False

    def problem(self) -> str | None:
        """What is wrong with this combination of flags, if anything."""
        if (self.basic_auth_user is None) != (self.basic_auth_password_file is None):
            return "--basic-auth-user and --basic-auth-password-file go together"
        if self.basic_auth_user is not None and self.bearer_token_file is not None:
            return "give basic auth or --bearer-token-file, not both"
        if self.ca_file is not None and self.insecure_skip_tls_verify:
            return "give --ca-file or --insecure-skip-tls-verify, not both"
        return None

    @property
    def has_credentials(self) -> bool:
        return self.basic_auth_user is not None or self.bearer_token_file is not None

    def headers(self) -> dict[str, str]:
        if self.basic_auth_user is not None and self.basic_auth_password_file is not None:
            pair = f"{self.basic_auth_user}:{_secret(self.basic_auth_password_file, 'password')}"
            return {"Authorization": "Basic " + base64.b64encode(pair.encode()).decode()}
        if self.bearer_token_file is not None:
            return {"Authorization": "Bearer " + _secret(self.bearer_token_file, "bearer token")}
        return {}

    def tls_context(self) -> ssl.SSLContext:
        if self.insecure_skip_tls_verify:
            return ssl._create_unverified_context()  # asked for by name: a lab Prometheus's own certificate
        try:
            return ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        except (OSError, ssl.SSLError) as error:
            raise PrometheusError(f"cannot use --ca-file {self.ca_file}: {error}") from error


PLAIN = Access()  # no credentials, the system's CAs


class Prometheus:
    def __init__(self, url: str, access: Access = PLAIN, timeout: float = 30.0) -> None:
        self._url = url.rstrip("/")
        self._access = access
        self._headers = access.headers()
        self._tls = access.tls_context() if self._url.startswith("https://") else None
        self._timeout = timeout

    def _get(self, path: str, params: dict[str, str]) -> list[Any]:
        """The answer's `data.result`, within one deadline of the timeout."""
        try:
            reply = outbound.fetch(f"{self._url}{path}?{urllib.parse.urlencode(params)}", self._headers,
                                   outbound.Deadline(self._timeout), limit=MAX_ANSWER_BYTES, tls=self._tls)
        except ssl.SSLCertVerificationError as error:
            raise PrometheusError(f"cannot verify the certificate of {self._url} ({error.verify_message}): give "
                                  "--ca-file with the CA that signed it, or --insecure-skip-tls-verify") from None
        except TimeoutError:
            raise PrometheusError(f"Prometheus at {self._url} did not answer within {self._timeout:g} s") from None
        except OSError as error:
            raise PrometheusError(f"cannot reach Prometheus at {self._url}: {error}") from None
        except http.client.HTTPException as error:  # a head that is not HTTP, a body cut short
            raise PrometheusError(f"Prometheus at {self._url}: a broken answer: {error!r}") from None
        except outbound.TooLargeError:
            raise PrometheusError(f"Prometheus at {self._url} answered more than {MAX_ANSWER_BYTES >> 20} MiB: "
                                  "narrow the report (--job, --node, a shorter span)") from None
        if 300 <= reply.status < 400:
            raise PrometheusError(f"Prometheus at {self._url} redirected to {reply.headers.get('Location')} "
                                  f"(HTTP {reply.status}): give that URL, redirects are not followed")
        if not 200 <= reply.status < 300:
            raise PrometheusError(self._refusal(reply))
        try:
            body = json.loads(reply.body)
        except ValueError as error:
            raise PrometheusError(f"Prometheus at {self._url}: an answer that is not JSON ({error})") from None
        if isinstance(body, dict) and body.get("status") == "error":
            raise PrometheusError(f"Prometheus: {str(body.get('error'))[:300]}")
        data = body.get("data") if isinstance(body, dict) and body.get("status") == "success" else None
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list):
            raise PrometheusError(f"Prometheus at {self._url}: not an API answer (no status success with a "
                                  f"data.result list): {reply.body[:200]!r}")
        return result

    def _refusal(self, reply: outbound.Reply) -> str:
        status = f"HTTP {reply.status} {reply.reason}"
        if reply.status in (401, 403):
            if self._access.has_credentials:
                return f"Prometheus at {self._url} refused the credentials ({status})"
            return (f"Prometheus at {self._url} asks for credentials ({status}): give --basic-auth-user with "
                    "--basic-auth-password-file, or --bearer-token-file")
        text = reply.body.decode(errors="replace")  # its first few KiB
        try:
            answer = json.loads(text)
            detail = str(answer.get("error", text) if isinstance(answer, dict) else text)
        except ValueError:
            detail = text
        lines = detail.strip().splitlines()
        return f"Prometheus at {self._url}: {status}" + (f": {lines[0][:300]}" if lines else "")

    def _malformed(self, error: Exception) -> PrometheusError:
        return PrometheusError(f"Prometheus at {self._url}: a result of another shape than the API's ({error!r})")

    def range(self, expr: str, start: float, end: float, step: float) -> list[tuple[Labels, Series]]:
        result = self._get("/api/v1/query_range",
                           {"query": expr, "start": str(start), "end": str(end), "step": f"{step:.3f}"})
        out = []
        for item in result:
            try:
                values = np.array(item["values"], dtype=np.float64)
                if values.ndim != 2 or values.shape[1] != 2 or not len(values):  # Prometheus sends no empty series
                    raise ValueError(f"values of shape {values.shape}, not (points, 2)")
                out.append((dict(item["metric"]), Series(values[:, 0], values[:, 1])))
            except (TypeError, KeyError, ValueError) as error:
                raise self._malformed(error) from None
        return out

    def instant(self, expr: str, at: float) -> list[tuple[Labels, float]]:
        try:
            return [(dict(item["metric"]), float(item["value"][1]))
                    for item in self._get("/api/v1/query", {"query": expr, "time": str(at)})]
        except (TypeError, KeyError, ValueError, IndexError) as error:
            raise self._malformed(error) from None
