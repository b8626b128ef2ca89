"""`stallwatch publish`: Grafana's documented HTTP API (a local server that checks every request)
and a real Prometheus that reloads the rules it was given."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

from stallwatch.harness import free_port
from stallwatch.publish import Grafana, PublishError, install_rules, reload_prometheus
from tests.conftest import require_binary

TOKEN = "glsa_test_token"
DASHBOARD = {"uid": "stallwatch-test", "title": "Test", "panels": [], "schemaVersion": 39}


class GrafanaDouble(ThreadingHTTPServer):
    """Answers the folder and dashboard endpoints with the shapes Grafana documents, and records calls."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), GrafanaHandler)
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.status_override: int | None = None


class GrafanaHandler(BaseHTTPRequestHandler):
    server: GrafanaDouble

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        self.server.calls.append((self.command, self.path))
        if self.server.status_override:
            self._send(self.server.status_override, {"message": "overridden"})
            return False
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(401, {"message": "invalid API key"})
            return False
        return True

    def do_GET(self) -> None:
        if not self._authorised():
            return
        if self.path.startswith("/api/folders/"):
            folder = self.server.folders.get(self.path.rsplit("/", 1)[1])
            self._send(200, folder) if folder else self._send(404, {"message": "folder not found"})
        elif self.path.startswith("/api/dashboards/uid/"):
            stored = self.server.dashboards.get(self.path.rsplit("/", 1)[1])
            self._send(200, stored) if stored else self._send(404, {"message": "Dashboard not found"})
        else:
            self._send(404, {"message": "not found"})

    def do_POST(self) -> None:
        if not self._authorised():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.headers["Content-Type"] == "application/json"
        if self.path == "/api/folders":
            assert set(body) == {"uid", "title"}
            self.server.folders[body["uid"]] = {"id": len(self.server.folders) + 1, **body}
            self._send(200, self.server.folders[body["uid"]])
        elif self.path == "/api/dashboards/db":
            assert body["overwrite"] is True and body["dashboard"]["id"] is None
            assert body["folderUid"] in self.server.folders, "dashboard posted into a folder that does not exist"
            uid = body["dashboard"]["uid"]
            version = self.server.dashboards.get(uid, {}).get("dashboard", {}).get("version", 0) + 1
            stored = {**body["dashboard"], "id": 7, "version": version}
            self.server.dashboards[uid] = {"dashboard": stored, "meta": {"folderUid": body["folderUid"]}}
            self._send(200, {"id": 7, "uid": uid, "status": "success", "version": version, "url": f"/d/{uid}"})
        else:
            self._send(404, {"message": "not found"})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def grafana() -> Iterator[GrafanaDouble]:
    server = GrafanaDouble()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def url_of(server: GrafanaDouble) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_publishes_into_a_new_folder_and_twice_changes_nothing(grafana: GrafanaDouble) -> None:
    client = Grafana(url_of(grafana), TOKEN)
    folder = client.ensure_folder("stallwatch", "stallwatch")
    assert client.publish_dashboard(DASHBOARD, folder) is True
    assert grafana.dashboards["stallwatch-test"]["dashboard"]["title"] == "Test"
    posts = [c for c in grafana.calls if c[0] == "POST"]
    assert client.ensure_folder("stallwatch", "stallwatch") == folder
    assert client.publish_dashboard(DASHBOARD, folder) is False
    assert [c for c in grafana.calls if c[0] == "POST"] == posts  # nothing written the second time
    assert grafana.dashboards["stallwatch-test"]["dashboard"]["version"] == 1
    assert client.publish_dashboard({**DASHBOARD, "title": "Changed"}, folder) is True
    assert grafana.dashboards["stallwatch-test"]["dashboard"]["version"] == 2


@pytest.mark.parametrize(("status", "message"), [(401, "rejected the token"), (403, "Editor role"),
                                                 (412, "same name or uid")])
def test_refusals_are_explained(grafana: GrafanaDouble, status: int, message: str) -> None:
    grafana.status_override = status
    with pytest.raises(PublishError, match=message):
        Grafana(url_of(grafana), TOKEN).publish_dashboard(DASHBOARD, "stallwatch")


def test_a_wrong_token_and_an_absent_grafana(grafana: GrafanaDouble) -> None:
    with pytest.raises(PublishError, match="401"):
        Grafana(url_of(grafana), "wrong").ensure_folder("stallwatch", "stallwatch")
    with pytest.raises(PublishError, match="not reachable"):
        Grafana(f"http://127.0.0.1:{free_port()}", TOKEN, timeout=2).ensure_folder("s", "s")


GOOD_RULES = """groups:
- name: stallwatch-publish-test
  rules:
  - record: job:up:sum
    expr: sum by (job) (up)
"""
BROKEN_RULES = GOOD_RULES.replace("sum by (job) (up)", "sum by (job) (up")


@contextlib.contextmanager
def running_prometheus(tmp_path: Path, lifecycle: bool = True) -> Iterator[tuple[str, Path]]:
    binary = require_binary("prometheus", "prometheus")
    rules = tmp_path / "rules"
    rules.mkdir(exist_ok=True)
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  evaluation_interval: 1s\nrule_files:\n  - {rules}/*.yaml\n")
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", *(["--web.enable-lifecycle"] if lifecycle else [])],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield url, rules
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    with running_prometheus(tmp_path) as running:
        yield running


def loaded_groups(url: str) -> set[str]:
    reply = requests.get(url + "/api/v1/rules", timeout=5).json()
    return {group["name"] for group in reply["data"]["groups"]}


def test_rules_reach_a_real_prometheus_and_a_broken_file_never_replaces_a_good_one(
    prometheus: tuple[str, Path], promtool: str
) -> None:
    url, rules = prometheus
    assert install_rules({"stallwatch.yaml": GOOD_RULES}, rules, promtool) == ["stallwatch.yaml"]
    reload_prometheus(url)
    assert "stallwatch-publish-test" in loaded_groups(url)
    assert install_rules({"stallwatch.yaml": GOOD_RULES}, rules, promtool) == []  # unchanged: not rewritten
    with pytest.raises(PublishError, match="failed promtool check rules"):
        install_rules({"stallwatch.yaml": BROKEN_RULES}, rules, promtool)
    assert (rules / "stallwatch.yaml").read_text() == GOOD_RULES
    assert sorted(p.name for p in rules.iterdir()) == ["stallwatch.yaml"]  # no staged leftovers
    reload_prometheus(url)
    assert "stallwatch-publish-test" in loaded_groups(url)


def test_reload_without_the_lifecycle_api_or_a_server_is_explained(tmp_path: Path) -> None:
    with running_prometheus(tmp_path, lifecycle=False) as (url, _), pytest.raises(
        PublishError, match=r"--web\.enable-lifecycle"
    ):
        reload_prometheus(url)
    with pytest.raises(PublishError, match="not reachable"):
        reload_prometheus(f"http://127.0.0.1:{free_port()}", timeout=2)
