"""`stallwatch publish`: push the generated dashboards and rules to where users look.

- Grafana: each dashboard through the HTTP API (`POST /api/dashboards/db`, overwrite) into a folder
  created when missing; a dashboard whose stored copy already matches is left alone, so publishing
  twice changes nothing. The service-account token comes from a file or `GRAFANA_TOKEN`, never a flag.
- Prometheus: each rule file is installed as `stallwatch-<name>.yaml`, the name the shipped scrape configs'
  `rule_files` glob (`rules/stallwatch-*.yaml`) loads. It is staged next to its target under a name no
  `*.yaml` glob matches, checked with `promtool check rules`, and only then moved over the old one
  (atomically). A broken rule never replaces a good file, and no staged file is left behind. With a
  URL, the server is asked first whether it is a Prometheus at all (before any file is written), then
  reloaded (`POST /-/reload`: it must run with `--web.enable-lifecycle`), then asked whether it loaded
  every rule group: a Prometheus that reads its rules from another directory is an error, not a success.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from stallwatch.mixin.generate import ARTIFACTS

TIMEOUT_SECONDS = 10.0
RULE_FILE_PREFIX = "stallwatch-"  # deploy/prometheus/scrape-*.yml load rules/stallwatch-*.yaml


class PublishError(Exception):
    """A failure the user can act on; the message is one line."""


# --- Grafana -------------------------------------------------------------------------------------------
class Grafana:
    def __init__(self, url: str, token: str, timeout: float = TIMEOUT_SECONDS) -> None:
        self._url = url.rstrip("/")
        self._token = token
        self._timeout = timeout

    def _request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self._url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as reply:
                return reply.status, json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as error:
            status, detail = error.code, _message(error.read())
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise PublishError(f"Grafana is not reachable at {self._url}: {reason}") from error
        if status == 404:
            return status, None
        if status == 401:
            raise PublishError(f"Grafana rejected the token (401 {detail}): check the token file or GRAFANA_TOKEN")
        if status == 403:
            raise PublishError(f"Grafana denied {method} {path} (403 {detail}): the service account needs the "
                               "Editor role on the folder")
        if status == 412:
            raise PublishError(f"Grafana refused {path} (412 {detail}): a dashboard with the same name or uid "
                               "exists elsewhere; move or delete it")
        raise PublishError(f"Grafana answered {status} to {method} {path}: {detail}")

    def ensure_folder(self, title: str, uid: str) -> str:
        status, folder = self._request("GET", f"/api/folders/{uid}")
        if status == 200 and folder:
            return str(folder["uid"])
        _, created = self._request("POST", "/api/folders", {"uid": uid, "title": title})
        return str(created["uid"])

    def publish_dashboard(self, dashboard: Mapping[str, Any], folder_uid: str) -> bool:
        """Upload one dashboard; False when the stored copy already matched (nothing was changed)."""
        uid = dashboard["uid"]
        status, stored = self._request("GET", f"/api/dashboards/uid/{uid}")
        unchanged = (
            status == 200
            and stored
            and stored.get("meta", {}).get("folderUid") == folder_uid
            and _comparable(stored["dashboard"]) == _comparable(dashboard)
        )
        if unchanged:
            return False
        body = {"dashboard": {**dashboard, "id": None}, "folderUid": folder_uid, "overwrite": True,
                "message": "stallwatch publish"}
        self._request("POST", "/api/dashboards/db", body)
        return True


def _comparable(dashboard: Mapping[str, Any]) -> dict[str, Any]:
    # Grafana adds its own bookkeeping to what it stores.
    return {k: v for k, v in dashboard.items() if k not in ("id", "version")}


def _message(body: bytes) -> str:
    """An error answer's message, on one line: a JSON body's `message`, else the start of the text."""
    try:
        text = str(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        text = body[:200].decode(errors="replace")
    return " ".join(text.split())


def read_token(path: str | None) -> str:
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as error:
            raise PublishError(f"cannot read the Grafana token file {path}: {error.strerror}") from error
    token = os.environ.get("GRAFANA_TOKEN", "").strip()
    if not token:
        raise PublishError("no Grafana token: pass --grafana.token-file or set GRAFANA_TOKEN")
    return token


# --- Prometheus ----------------------------------------------------------------------------------------
def find_promtool(promtool: str) -> str:
    """The promtool to run: a path as given, a bare name looked up on PATH."""
    found = shutil.which(promtool)
    if found is None:
        raise PublishError(f"promtool not found: {promtool!r} is not an executable file nor a command on PATH "
                           "(install Prometheus's promtool or pass --promtool PATH)")
    return found


def install_rules(rules: Mapping[str, str], directory: Path, promtool: str) -> list[str]:
    """Check each rule file with promtool, then move it into place atomically. Returns the names that changed.

    Each file is installed as RULE_FILE_PREFIX + its name; the staged copy ends in `.tmp`, so a Prometheus
    loading `*.yaml` from the directory never sees it, and it is removed whatever happens.
    """
    promtool = find_promtool(promtool)
    directory.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in rules.items():
        target = directory / (RULE_FILE_PREFIX + name)
        if target.exists() and target.read_text() == text:
            continue
        fd, staged = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            try:
                check = subprocess.run([promtool, "check", "rules", staged], capture_output=True, text=True,
                                       timeout=60)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise PublishError(f"cannot run promtool ({promtool}): {error}") from error
            if check.returncode != 0:
                detail = " ".join((check.stdout + check.stderr).split())
                raise PublishError(f"{target.name} failed promtool check rules, the installed copy is unchanged: "
                                   f"{detail}")
            os.chmod(staged, 0o644)
            os.replace(staged, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
        changed.append(target.name)
    return changed


class Prometheus:
    """The Prometheus HTTP API calls publish makes; every failure is a PublishError but `_RefusedError`'s, kept
    for the caller to explain."""

    def __init__(self, url: str, timeout: float = TIMEOUT_SECONDS) -> None:
        self._url = url.rstrip("/")
        self._timeout = timeout

    def _request(self, method: str, path: str) -> bytes:
        request = urllib.request.Request(self._url + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as reply:
                return bytes(reply.read())
        except urllib.error.HTTPError as error:
            raise _RefusedError(error.code, f"{error.code} {_message(error.read()) or error.reason}") from error
        except (urllib.error.URLError, OSError) as error:
            raise PublishError(f"Prometheus is not reachable at {self._url}: {getattr(error, 'reason', error)}"
                               ) from error

    def _api(self, path: str) -> Any:
        """The `data` of a Prometheus HTTP API answer; anything else means the URL is not a Prometheus."""
        not_prometheus = PublishError(f"{self._url} is not a Prometheus (GET {path} did not answer as Prometheus's "
                                      "HTTP API does): give its base URL, e.g. http://prometheus:9090")
        try:
            reply = json.loads(self._request("GET", path))
        except (_RefusedError, ValueError) as error:
            raise not_prometheus from error
        if not isinstance(reply, dict) or reply.get("status") != "success":
            raise not_prometheus
        return reply.get("data")

    def check(self) -> None:
        """Fail unless the URL answers as a Prometheus."""
        self._api("/api/v1/status/buildinfo")

    def reload(self) -> None:
        try:
            self._request("POST", "/-/reload")
        except _RefusedError as refusal:
            hint = " (start Prometheus with --web.enable-lifecycle)" if refusal.status in (403, 404) else ""
            raise PublishError(f"Prometheus refused the reload: {refusal.detail}{hint}") from refusal

    def missing_groups(self, names: set[str]) -> list[str]:
        """The rule groups of `names` the server has not loaded."""
        data = self._api("/api/v1/rules")
        loaded = {group.get("name") for group in data.get("groups", [])} if isinstance(data, dict) else set()
        return sorted(names - loaded)


class _RefusedError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def reload_prometheus(url: str, rules: Mapping[str, str], rules_dir: Path, timeout: float = TIMEOUT_SECONDS) -> None:
    """Reload the Prometheus at `url` and make sure it loaded every group of `rules` (installed in `rules_dir`)."""
    prometheus = Prometheus(url, timeout)
    prometheus.reload()
    names = {group["name"] for text in rules.values() for group in yaml.safe_load(text)["groups"]}
    missing = prometheus.missing_groups(names)
    if missing:
        raise PublishError(f"Prometheus at {url} reloaded but did not load {len(missing)} of the {len(names)} rule "
                           f"groups ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): its rule_files "
                           f"must include {rules_dir.resolve()}/{RULE_FILE_PREFIX}*.yaml; is it the Prometheus "
                           "that reads that directory?")


# --- the command ---------------------------------------------------------------------------------------
def generated(prefix: str) -> dict[str, str]:
    """Fresh renders of the artifacts under `prefix`, by file name."""
    return {Path(p).name: render() for p, render in ARTIFACTS.items() if p.startswith(prefix)}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallwatch publish", description=__doc__.splitlines()[0])
    parser.add_argument("--grafana.url", dest="grafana_url", help="Grafana base URL, e.g. http://grafana:3000")
    parser.add_argument("--grafana.token-file", dest="grafana_token_file",
                        help="file holding a service-account token (default: $GRAFANA_TOKEN)")
    parser.add_argument("--grafana.folder", dest="grafana_folder", default="stallwatch", help="(default: %(default)s)")
    parser.add_argument("--prometheus.rules-dir", dest="rules_dir", type=Path,
                        help="directory Prometheus loads rule files from (rule_files glob)")
    parser.add_argument("--prometheus.url", dest="prometheus_url",
                        help="reload this Prometheus after writing rules, and check that it loaded them")
    parser.add_argument("--promtool", default="promtool",
                        help="promtool to check rules with, a path or a command on PATH (default: %(default)s)")
    options = parser.parse_args(argv)
    if not options.grafana_url and not options.rules_dir:
        parser.error("nothing to do: give --grafana.url and/or --prometheus.rules-dir")
    if options.prometheus_url and not options.rules_dir:
        parser.error("--prometheus.url reloads the rules written to --prometheus.rules-dir: give both")
    try:
        if options.prometheus_url:  # before anything is written: a wrong URL changes nothing
            Prometheus(options.prometheus_url).check()
        if options.grafana_url:
            grafana = Grafana(options.grafana_url, read_token(options.grafana_token_file))
            folder = grafana.ensure_folder(options.grafana_folder, options.grafana_folder.lower())
            for name, text in generated("dashboards/").items():
                changed = grafana.publish_dashboard(json.loads(text), folder)
                print(f"grafana: {name}: {'published' if changed else 'unchanged'}")
        if options.rules_dir:
            rules = generated("alerts/")
            changed_rules = install_rules(rules, options.rules_dir, options.promtool)
            print(f"prometheus: {len(changed_rules)} rule file(s) updated in {options.rules_dir}")
            if options.prometheus_url:  # reloaded even when nothing changed: it may not have loaded them yet
                reload_prometheus(options.prometheus_url, rules, options.rules_dir)
                print(f"prometheus: reloaded {options.prometheus_url}, every rule group loaded")
    except PublishError as error:
        print(f"stallwatch publish: error: {error}", file=sys.stderr)
        return 1
    return 0
