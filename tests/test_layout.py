"""One file, one module name: no link or second path entry loads a module twice under two names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_the_tree_has_no_symbolic_links() -> None:
    staged = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in staged.splitlines() if line.startswith("120000 ")]
    assert links == []


def test_only_stallwatch_is_importable_from_the_root() -> None:
    packages = sorted(path.parent.name for path in ROOT.glob("*/__init__.py"))
    assert packages == ["stallwatch", "tests"]


@pytest.mark.parametrize("package", ["exporters", "correlator", "client", "demo", "mixin", "report"])
def test_a_subpackage_under_a_second_name_is_a_one_line_import_error(package: str) -> None:
    probe = f"import sys; sys.path.insert(0, {str(ROOT / 'stallwatch')!r}); import {package}"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"ImportError: import stallwatch.{package}, not {package}: one file, one module name"
