"""Run a correlator test on the C kernels (stallwatch/correlator/_kernels.c) and on their NumPy versions.

`@IMPLEMENTATIONS` parametrises a test with `implementation`, "c" or "numpy"; the test runs its body under
`using(implementation)`. A parameter, not a fixture: hypothesis's tests take no function-scoped fixtures."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import pytest

from stallwatch.correlator import native

BUILT = native.kernels

IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [
    pytest.param("c", marks=pytest.mark.skipif(BUILT is None, reason="the C kernels are not built (setup.py)")),
    "numpy"])


def using(implementation: str) -> AbstractContextManager[None]:
    return nullcontext() if implementation == "c" else native.numpy_versions()
