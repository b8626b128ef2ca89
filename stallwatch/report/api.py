"""Prometheus's HTTP API as the report asks it, through basic auth or a bearer token and TLS.

Secrets come from files only (a password on the command line is in every `ps` listing and shell history).
Every failure is a `PrometheusError` with one line that says what to change.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stallwatch.report.run import Series

Labels = dict[str, str]


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

    def _get(self, path: str, params: dict[str, str]) -> Any:
        request = urllib.request.Request(f"{self._url}{path}?{urllib.parse.urlencode(params)}", headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout, context=self._tls) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as error:
            raise PrometheusError(self._refusal(error)) from None
        except urllib.error.URLError as error:
            raise PrometheusError(self._unreachable(error.reason)) from None
        except (OSError, ValueError) as error:  # a reset connection, a reply that is not JSON
            raise PrometheusError(f"Prometheus at {self._url}: {error}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus: {body.get('error', body)}")
        return body["data"]["result"]

    def _refusal(self, error: urllib.error.HTTPError) -> str:
        status = f"HTTP {error.code} {error.reason}"
        if error.code in (401, 403):
            if self._access.has_credentials:
                return f"Prometheus at {self._url} refused the credentials ({status})"
            return (f"Prometheus at {self._url} asks for credentials ({status}): give --basic-auth-user with "
                    "--basic-auth-password-file, or --bearer-token-file")
        text = error.read().decode(errors="replace")
        try:
            detail = json.loads(text).get("error", text)
        except ValueError:
            detail = text.strip().splitlines()[0] if text.strip() else ""
        return f"Prometheus at {self._url}: {status}" + (f": {detail}" if detail else "")

    def _unreachable(self, reason: object) -> str:
        if isinstance(reason, ssl.SSLCertVerificationError):
            return (f"cannot verify the certificate of {self._url} ({reason.verify_message}): give --ca-file "
                    "with the CA that signed it, or --insecure-skip-tls-verify")
        return f"cannot reach Prometheus at {self._url}: {reason}"

    def range(self, expr: str, start: float, end: float, step: float) -> list[tuple[Labels, Series]]:
        result = self._get("/api/v1/query_range",
                           {"query": expr, "start": str(start), "end": str(end), "step": f"{step:.3f}"})
        out = []
        for item in result:
            values = np.array(item["values"], dtype=np.float64).reshape(-1, 2)
            out.append((item["metric"], Series(values[:, 0], values[:, 1])))
        return out

    def instant(self, expr: str, at: float) -> list[tuple[Labels, float]]:
        return [(item["metric"], float(item["value"][1]))
                for item in self._get("/api/v1/query", {"query": expr, "time": str(at)})]
