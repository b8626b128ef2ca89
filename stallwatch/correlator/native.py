"""The correlator's C kernels (`_kernels.c`, built by setup.py), or None where they were not built: the
functions that use them (intervals.py, reuse.py) then run their NumPy versions, with the same results.
Tests set `kernels` to None to hold the two alike."""

from __future__ import annotations

from types import ModuleType

kernels: ModuleType | None
try:
    from stallwatch.correlator import _kernels as kernels
except ImportError:  # no C compiler where it was installed, or STALLWATCH_AGENT_PURE=1
    kernels = None
