"""Real Prometheus and Alertmanager on loopback, with a webhook receiver that collects what they send.

The demo starts these when Debian's `prometheus` and `prometheus-alertmanager` are installed, and the
live tests use the same runners. Each server gets its own working directory and a free port.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from stallwatch.harness import free_port, http_ok, stop_process, wait_for


class Webhook:
    """An Alertmanager webhook receiver: every notification lands in `received` (and `on_alert`)."""

    def __init__(self, on_alert: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.received: queue.Queue[dict[str, Any]] = queue.Queue()
        received, callback = self.received, on_alert

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received.put(body)
                if callback is not None:
                    callback(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Server:
    """A started process with its URL and log; `close()` stops it."""

    def __init__(self, command: Sequence[str], url: str, log: Path, ready_path: str) -> None:
        self.url = url
        self.log = log
        with log.open("wb") as sink:
            self.process = subprocess.Popen(list(command), stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_for(command[0], lambda: http_ok(url + ready_path), 60, self.process, log)
        except RuntimeError:
            self.close()
            raise

    def close(self) -> None:
        stop_process(self.process)


def start_alertmanager(binary: str, workdir: Path, webhook_url: str, group_wait: str = "1s",
                       send_resolved: bool = False) -> Server:
    """`send_resolved`: the webhook also hears when an alert stops firing (the demo's live line drops it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump({
        "route": {"receiver": "hook", "group_by": ["alertname", "instance"], "group_wait": group_wait,
                  "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "hook", "webhook_configs": [{"url": webhook_url, "send_resolved": send_resolved}]}],
    }))
    port = free_port()
    return Server([binary, f"--config.file={workdir / 'alertmanager.yml'}", f"--storage.path={workdir / 'data'}",
                   f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                  f"http://127.0.0.1:{port}", workdir / "alertmanager.log", "/-/ready")


# The `node` label the dashboards key nodes on: the target's host without its port, as
# deploy/prometheus/scrape-*.yml set it (tests/test_deploy.py keeps the two equal).
NODE_RELABEL: dict[str, Any] = {"source_labels": ["__address__"], "regex": "(.+):\\d+", "target_label": "node"}


# Several emulated nodes on one host: a target's hidden `__node_name` label, where given, names its node.
NAMED_NODE_RELABEL: dict[str, Any] = {"source_labels": ["__node_name"], "regex": "(.+)", "target_label": "node"}


RELABELS = [NODE_RELABEL, NAMED_NODE_RELABEL]


SCRAPE_INTERVAL_SECONDS = 1  # the demo's and the tests' Prometheus: scrape and rule evaluation


def start_prometheus(binary: str, workdir: Path, targets: Sequence[str], rule_files: Sequence[Path],
                     alertmanager: str | None = None, interval_seconds: int = SCRAPE_INTERVAL_SECONDS,
                     job: str = "stallwatch", node_names: Mapping[str, str] | None = None,
                     extra: Mapping[str, Any] | None = None, flags: Sequence[str] = ()) -> Server:
    """Scrape `targets` as `job` (the agents carry the training job as `training_job`: no collision).

    `node_names` maps a target to the node name it is labelled with (else its host); `extra` adds top-level
    configuration (remote_write), `flags` command-line flags (the remote-write receiver)."""
    workdir.mkdir(parents=True, exist_ok=True)
    names = node_names or {}
    static = ([{"targets": [target], "labels": {"__node_name": names[target]}} for target in targets] if names
              else [{"targets": list(targets)}])
    config: dict[str, Any] = {
        "global": {"scrape_interval": f"{interval_seconds}s", "evaluation_interval": f"{interval_seconds}s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": job, "relabel_configs": RELABELS,
                            "static_configs": static}] if targets else [],
        **(extra or {}),
    }
    if alertmanager is not None:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager.split("//")[1]]}]}]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    return Server([binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                   f"--web.listen-address=127.0.0.1:{port}", *flags], f"http://127.0.0.1:{port}",
                  workdir / "prometheus.log", "/-/ready")


def query(prometheus: str, expr: str, at: float | None = None) -> dict[str, Any]:
    """An instant query, now or at the Unix time `at`."""
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr, **({"time": at} if at else {})})
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            result: dict[str, Any] = json.loads(reply.read())
    except urllib.error.HTTPError as error:  # a bad expression answers 400 with the error in the body
        result = json.loads(error.read())
    return result
