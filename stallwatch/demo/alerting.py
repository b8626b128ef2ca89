"""The demos' Alertmanager and the webhook that hears it: every alert it delivers, said as it comes.

Both demos start it the same way when Debian's `prometheus-alertmanager` is installed, and point their
Prometheus at it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stallwatch.demo.stack import Webhook, start_alertmanager
from stallwatch.harness import find_binary


class AlertWatch:
    """What the webhook heard: every alert (`alerts`), when each last began firing (`fired_at`, unix time)
    and those firing now (`firing`: resolved ones are dropped)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.alerts: list[dict[str, Any]] = []
        self.fired_at: dict[str, float] = {}
        self.firing: set[str] = set()
        self._lock = threading.Lock()

    def start(self, stack: contextlib.ExitStack, work: Path) -> str | None:
        """Start the webhook and Alertmanager (stopped when `stack` closes); Alertmanager's URL, or None when
        it is not installed."""
        binary = find_binary("prometheus-alertmanager")
        if binary is None:
            self.say("  (Debian's prometheus-alertmanager is not installed: alerts are not delivered)")
            return None
        webhook = Webhook(self._on_alert)
        stack.callback(webhook.close)
        alertmanager = start_alertmanager(binary, work / "alertmanager", webhook.url, send_resolved=True)
        stack.callback(alertmanager.close)
        self.say(f"  alertmanager {alertmanager.url} -> webhook {webhook.url}")
        return alertmanager.url

    def names(self) -> list[str]:
        with self._lock:
            return sorted({alert["labels"]["alertname"] for alert in self.alerts})

    def _on_alert(self, notification: dict[str, Any]) -> None:
        for alert in notification.get("alerts", []):
            name, status = alert.get("labels", {}).get("alertname", "?"), alert.get("status")
            with self._lock:
                self.alerts.append(alert)
                if status == "firing":
                    if name not in self.firing:
                        self.fired_at[name] = time.time()
                    self.firing.add(name)
                else:
                    self.firing.discard(name)
            self.say(f"  ALERT received by the webhook: {name} ({status}) "
                     f"{alert.get('annotations', {}).get('description', '')}")
