"""A real nginx run as the current user with its own prefix: the demo's spoke, and the tests' one.

`Nginx` writes a complete configuration under `prefix` (temp paths, a `proxy_cache_path` of the
given size, the stallwatch access-log format) around the `server_block` it is given, starts nginx in
the foreground and waits until it listens. `spoke_server_block()` is the read-through cache the demo
puts in front of its hub.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from stallwatch.exporters.spoke_nginx import LOG_FORMAT
from stallwatch.harness import find_binary, free_port, stop_process


def nginx_binary() -> str:
    return find_binary("nginx") or "/usr/sbin/nginx"


def spoke_server_block(hub_url: str, timeout_seconds: int = 120, valid: str | None = None) -> str:
    """A read-through cache of whole shards in front of `hub_url`, telling clients its verdict. A shard stays
    fresh as long as the hub says; with `valid`, that long whatever the hub says (1s: nearly every read goes
    back to the hub)."""
    freshness = ("proxy_cache_valid 200 30d;" if valid is None
                 else f"proxy_cache_valid 200 {valid}; proxy_ignore_headers Cache-Control Expires;")
    return f"""
        location / {{
            proxy_cache spoke;
            {freshness}
            proxy_cache_lock on;
            proxy_cache_lock_timeout {timeout_seconds}s;
            proxy_read_timeout {timeout_seconds}s;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_pass {hub_url};
            add_header X-Cache-Status $upstream_cache_status always;
        }}
"""


class Nginx:
    def __init__(self, prefix: Path, server_block: str, cache_max_size: str = "64m") -> None:
        self.prefix = prefix
        self.port = free_port()
        for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi", "cache", "logs"):
            (prefix / name).mkdir(parents=True, exist_ok=True)
        self.access_log = prefix / "logs" / "access.log"
        self.error_log = prefix / "logs" / "error.log"
        # Unprivileged, nginx runs as the current user; as root it would switch its workers to nobody,
        # who cannot write this prefix, so then it is told to stay root.
        user = "user root;" if os.geteuid() == 0 else ""
        (prefix / "nginx.conf").write_text(f"""
{user}
worker_processes 1;
error_log {self.error_log} info;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    {LOG_FORMAT}
    access_log {self.access_log} stallwatch;
    proxy_cache_path {prefix}/cache levels=1:2 keys_zone=spoke:4m max_size={cache_max_size} inactive=1d;
    server {{
        listen 127.0.0.1:{self.port};
        {server_block}
    }}
}}
""")
        self._globals = f"daemon off; pid {prefix}/nginx.pid;"
        self.process = subprocess.Popen(
            [nginx_binary(), "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", self._globals],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode() if self.process.stderr else ""
                errors = self.error_log.read_text() if self.error_log.exists() else ""
                raise RuntimeError(f"nginx exited: {stderr}{errors}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("nginx did not start listening")

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def reopen(self) -> None:
        """`nginx -s reopen`: what logrotate's postrotate runs after renaming the log."""
        subprocess.run([nginx_binary(), "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf"),
                        "-g", self._globals, "-s", "reopen"], check=True, capture_output=True, timeout=10)

    def close(self) -> None:
        stop_process(self.process, signal.SIGQUIT)  # nginx's graceful shutdown
