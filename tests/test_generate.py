"""Generated artifacts are committed fresh: `stallwatch generate --check` says which are stale."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from stallwatch.mixin.generate import ARTIFACTS, stale
from tests.conftest import ROOT


def test_committed_artifacts_are_fresh() -> None:
    assert stale(ROOT) == [], "run `make generate` and commit the result"


def test_check_flags_a_stale_copy(tmp_path: Path) -> None:
    for relative in ARTIFACTS:
        target = tmp_path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / relative, target)
    edited = next(iter(ARTIFACTS))
    (tmp_path / edited).write_text((tmp_path / edited).read_text() + "edited by hand\n")
    result = subprocess.run([sys.executable, "-m", "stallwatch", "generate", "--root", str(tmp_path), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"stale: {edited}" in result.stderr
    subprocess.run([sys.executable, "-m", "stallwatch", "generate", "--root", str(tmp_path)], check=True,
                   capture_output=True, timeout=60)
    assert stale(tmp_path) == []
