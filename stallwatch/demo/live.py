"""The demos' live line: redrawn in place at the bottom of the terminal, the demo's messages above it."""

from __future__ import annotations

import threading
import time


class LiveLine:
    """The line the demo keeps rewriting at the bottom: the epoch's bar from the trainer's progress and the
    status from the agent's scrapes. Both redraw it: the trainer prints nothing while it waits out an outage,
    and the scrapes still show the stall. The demo's messages and finished epochs' lines go above it. One
    lock keeps the line and the messages whole."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.started = time.time()
        self.lock = threading.Lock()
        self.bar = "starting"
        self.status = ""
        self.transcript: list[str] = []  # every message, in order
        self._live = False  # drawn from the training's start to its end
        self._width = 0  # of the line drawn last: a shorter one is padded over it

    def begin(self) -> float:
        """The training starts: draw the line from now on; the time it started."""
        with self.lock:
            self.started, self._live = time.time(), True
            return self.started

    def progress(self, epoch: int, step: int, steps: int) -> None:
        with self.lock:
            done = int(30 * step / steps)
            self.bar = f"epoch {epoch:2d} [{'#' * done}{'.' * (30 - done)}] {step:3d}/{steps}"
            self._draw()

    def show(self, status: str, bar: str | None = None) -> None:
        with self.lock:
            self.status = status
            self.bar = self.bar if bar is None else bar
            self._draw()

    def say(self, text: str) -> None:
        """Print `text` on a line of its own, above the live line."""
        with self.lock:
            self.transcript.append(text)
            self._write("\r" + " " * self._width + "\r" + text + "\n")
            self._width = 0
            self._draw()

    def close(self) -> None:
        """Clear the live line and draw it no more: the training is over."""
        with self.lock:
            self._write("\r" + " " * self._width + "\r")
            self._live, self._width = False, 0

    def _draw(self) -> None:
        if self._live:
            line = f"  {self.bar}  {self.status}  {time.time() - self.started:5.0f}s"
            self._write("\r" + line.ljust(self._width))
            self._width = len(line)

    def _write(self, text: str) -> None:
        if not self.quiet:
            print(text, end="", flush=True)
