"""`pip install .` gives a wheel whose packages import on their own, without the checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import ROOT


def test_the_wheel_carries_every_package_and_imports_from_its_install(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("stallwatch-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for member in ("stallwatch/py.typed", "stallwatch/exporters/gpu.py", "stallwatch/correlator/pipeline.py",
                   "stallwatch/client/wire.py", "stallwatch/exporters/mappings/juicefs.yaml"):
        assert member in names, member
    assert not any(name.startswith(("exporters/", "correlator/", "tests/")) for name in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = ("import stallwatch, stallwatch.exporters.agent, stallwatch.correlator.pipeline, stallwatch.client;"
             "print(stallwatch.__file__)")
    # Run from an empty folder with the installed copy first on the path: nothing comes from the checkout.
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(target))
