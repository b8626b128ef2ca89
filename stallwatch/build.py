"""What this copy of stallwatch is: its version and, where it can be known, the git revision it was built from.

The revision comes from, in order: a `_revision` file beside this module (an image build writes it:
`git rev-parse HEAD > stallwatch/_revision`); the commit pip recorded when it installed from git
(`direct_url.json` of PEP 610); the git checkout the package runs from (an editable install). Otherwise
it is "unknown".
"""

from __future__ import annotations

import functools
import json
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from stallwatch import __version__

UNKNOWN = "unknown"
_HERE = Path(__file__).resolve().parent
_SHORT = 12  # hex digits shown, as `git rev-parse --short=12`


@functools.cache
def revision() -> str:
    return (_from_file(_HERE / "_revision") or _from_direct_url(_direct_url()) or _from_checkout(_HERE.parent)
            or UNKNOWN)


def version_text(program: str) -> str:
    """What `--version` prints, in the form of the Prometheus exporters (one line: argparse reflows text)."""
    return f"{program}, version {__version__} (revision: {revision()}, python: {platform.python_version()})"


def _from_file(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return _hex(text)


def _direct_url() -> str | None:
    try:
        return distribution("stallwatch").read_text("direct_url.json")
    except PackageNotFoundError:
        return None


def _from_direct_url(text: str | None) -> str | None:
    """The commit in pip's record of where it installed from (`vcs_info.commit_id`), if it installed from git."""
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    vcs = record.get("vcs_info") if isinstance(record, dict) else None
    return _hex(str(vcs.get("commit_id", ""))) if isinstance(vcs, dict) else None


def _from_checkout(root: Path) -> str | None:
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return _hex(done.stdout.strip()) if done.returncode == 0 else None


def _hex(text: str) -> str | None:
    """A commit id shortened for a label, or None when `text` is not one."""
    if len(text) < 7 or any(c not in "0123456789abcdef" for c in text.lower()):
        return None
    return text.lower()[:_SHORT]
