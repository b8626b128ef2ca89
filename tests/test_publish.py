"""`stallwatch publish`: Grafana's documented HTTP API (a local server that checks every request)
and a real Prometheus that reloads the rules it was given."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from stallwatch.harness import free_port
from stallwatch.publish import Grafana, PublishError, find_promtool, generated, install_rules, reload_prometheus
from tests.conftest import ROOT, require_binary

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
def running_prometheus(tmp_path: Path, lifecycle: bool = True, config: Path | None = None
                       ) -> Iterator[tuple[str, Path]]:
    """A Prometheus loading `rules/*.yaml` under tmp_path, or running the given config file."""
    binary = require_binary("prometheus", "prometheus")
    rules = tmp_path / "rules"
    rules.mkdir(exist_ok=True)
    if config is None:
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
    installed = "stallwatch-test.yaml"
    assert install_rules({"test.yaml": GOOD_RULES}, rules, promtool) == [installed]
    reload_prometheus(url, {"test.yaml": GOOD_RULES}, rules)
    assert "stallwatch-publish-test" in loaded_groups(url)
    assert install_rules({"test.yaml": GOOD_RULES}, rules, promtool) == []  # unchanged: not rewritten
    with pytest.raises(PublishError, match="failed promtool check rules"):
        install_rules({"test.yaml": BROKEN_RULES}, rules, promtool)
    assert (rules / installed).read_text() == GOOD_RULES
    assert sorted(p.name for p in rules.iterdir()) == [installed]  # no staged leftovers
    reload_prometheus(url, {"test.yaml": GOOD_RULES}, rules)
    assert "stallwatch-publish-test" in loaded_groups(url)


@pytest.mark.parametrize("promtool", ["/nonexistent/promtool", "no-such-promtool-command", "/etc/hostname"])
def test_an_unusable_promtool_is_one_line_and_leaves_nothing_behind(tmp_path: Path, promtool: str) -> None:
    rules = tmp_path / "rules"
    with pytest.raises(PublishError, match=r"promtool not found|cannot run promtool") as error:
        install_rules({"test.yaml": GOOD_RULES}, rules, promtool)
    assert "\n" not in str(error.value)
    assert not rules.exists() or not list(rules.iterdir())
    command = subprocess.run([sys.executable, "-m", "stallwatch", "publish", "--prometheus.rules-dir", str(rules),
                              "--promtool", promtool], capture_output=True, text=True, timeout=120)
    assert command.returncode == 1 and "Traceback" not in command.stderr
    assert command.stderr.count("\n") == 1 and "promtool" in command.stderr
    assert not rules.exists() or not list(rules.iterdir())


def test_a_promtool_that_cannot_run_leaves_no_staged_file(tmp_path: Path) -> None:
    # An executable that the kernel refuses to start (no interpreter): the staged copy is still removed.
    broken = tmp_path / "promtool"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    rules = tmp_path / "rules"
    with pytest.raises(PublishError, match="cannot run"):
        install_rules({"test.yaml": GOOD_RULES}, rules, str(broken))
    assert list(rules.iterdir()) == []


def test_promtool_is_found_on_path_by_default(tmp_path: Path, promtool: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "promtool").symlink_to(promtool)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert find_promtool("promtool") == str(bin_dir / "promtool")
    rules = tmp_path / "rules"
    assert install_rules({"test.yaml": GOOD_RULES}, rules, "promtool") == ["stallwatch-test.yaml"]


def test_what_publish_writes_loads_through_the_shipped_scrape_config(tmp_path: Path, promtool: str) -> None:
    # The shipped config, its /etc/prometheus paths pointed here: every generated group loads, none twice.
    rules = tmp_path / "rules"
    shipped = (ROOT / "deploy/prometheus/scrape-static.yml").read_text()
    assert "/etc/prometheus/rules/stallwatch-*.yaml" in shipped
    config = tmp_path / "prometheus.yml"
    config.write_text(shipped.replace("/etc/prometheus/", f"{tmp_path}/"))
    result = subprocess.run([sys.executable, "-m", "stallwatch", "publish", "--prometheus.rules-dir", str(rules),
                             "--promtool", promtool], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with running_prometheus(tmp_path, config=config) as (url, _):
        reply = requests.get(url + "/api/v1/rules", timeout=5).json()
    groups = [group["name"] for group in reply["data"]["groups"]]
    expected = {g["name"] for text in generated("alerts/").values() for g in yaml.safe_load(text)["groups"]}
    assert sorted(groups) == sorted(expected) and len(groups) == len(set(groups))
    assert sum(len(group["rules"]) for group in reply["data"]["groups"]) > 0


def test_reload_without_the_lifecycle_api_or_a_server_is_explained(tmp_path: Path) -> None:
    with running_prometheus(tmp_path, lifecycle=False) as (url, rules), pytest.raises(
        PublishError, match=r"--web\.enable-lifecycle"
    ):
        reload_prometheus(url, {}, rules)
    with pytest.raises(PublishError, match="not reachable"):
        reload_prometheus(f"http://127.0.0.1:{free_port()}", {}, tmp_path, timeout=2)


def publish(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stallwatch", "publish", *args], capture_output=True, text=True,
                          timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("stallwatch publish: error:") and all(w in result.stderr for w in words)


def test_a_prometheus_url_nothing_answers_or_not_a_prometheus_fails_before_writing_rules(
    tmp_path: Path, grafana: GrafanaDouble, promtool: str
) -> None:
    rules = tmp_path / "rules"
    absent = f"http://127.0.0.1:{free_port()}"
    for url, words in ((absent, ("not reachable", absent)), (url_of(grafana), ("is not a Prometheus",))):
        assert_one_line_error(publish("--prometheus.rules-dir", str(rules), "--prometheus.url", url,
                                      "--promtool", promtool), *words)
        assert not rules.exists()
    # Rules already in place (nothing to update) do not make a wrong URL a success.
    assert publish("--prometheus.rules-dir", str(rules), "--promtool", promtool).returncode == 0
    assert_one_line_error(publish("--prometheus.rules-dir", str(rules), "--prometheus.url", absent,
                                  "--promtool", promtool), "not reachable")


def test_a_prometheus_that_reads_its_rules_elsewhere_is_an_error_and_the_right_one_is_checked_each_time(
    prometheus: tuple[str, Path], tmp_path: Path, promtool: str
) -> None:
    url, read_by_prometheus = prometheus
    elsewhere = tmp_path / "elsewhere"
    assert_one_line_error(publish("--prometheus.rules-dir", str(elsewhere), "--prometheus.url", url,
                                  "--promtool", promtool), "did not load", str(elsewhere))
    expected = {g["name"] for text in generated("alerts/").values() for g in yaml.safe_load(text)["groups"]}
    for updated in ("updated", "0 rule file(s) updated"):  # the second run writes nothing, and still checks
        result = publish("--prometheus.rules-dir", str(read_by_prometheus), "--prometheus.url", url,
                         "--promtool", promtool)
        assert result.returncode == 0 and updated in result.stdout, result.stderr
        assert loaded_groups(url) == expected


def test_a_prometheus_url_needs_the_rules_dir_and_an_absent_grafana_fails(tmp_path: Path) -> None:
    result = publish("--grafana.url", "http://127.0.0.1:1", "--prometheus.url", "http://127.0.0.1:1")
    assert result.returncode == 2 and "--prometheus.rules-dir" in result.stderr
    token = tmp_path / "token"
    token.write_text(TOKEN)
    absent = f"http://127.0.0.1:{free_port()}"
    assert_one_line_error(publish("--grafana.url", absent, "--grafana.token-file", str(token)), "Grafana",
                          "not reachable")


@pytest.mark.parametrize(("module", "argv", "extra"), [
    ("grafana_foundation_sdk", ["publish", "--prometheus.rules-dir", "rules"], "generate"),
    ("grafana_foundation_sdk", ["generate"], "generate"),
    ("matplotlib", ["report", "--windows", "windows.jsonl"], "report"),
])
def test_a_missing_extra_is_one_line_naming_it(tmp_path: Path, module: str, argv: list[str], extra: str) -> None:
    # The extra's module made unimportable, as in an installation without it.
    program = (f"import sys; sys.modules[{module!r}] = None; from stallwatch.cli import main; "
               f"sys.exit(main({argv!r}))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and f"-py3-none-any.whl[{extra}]'" in result.stderr
    assert not (tmp_path / "rules").exists()
