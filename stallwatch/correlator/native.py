"""The correlator's C kernels (`_kernels.c`, built by setup.py), or None where they were not built: the
functions that use them (intervals.py, reuse.py) then run their NumPy versions, with the same results.
`numpy_versions()` runs them for a while: tests hold the two alike, the benchmark measures both."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

kernels: ModuleType | None
try:
    from stallwatch.correlator import _kernels as kernels
except ImportError:  # no C compiler where it was installed, or STALLWATCH_AGENT_PURE=1
    kernels = None


@contextmanager
def numpy_versions() -> Iterator[None]:
    """Within it, the functions that use the kernels run their NumPy versions."""
    global kernels  # noqa: PLW0603  # the module's one switch, set back on the way out
    built, kernels = kernels, None
    try:
        yield
    finally:
        kernels = built
