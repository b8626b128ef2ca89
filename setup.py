"""The agent's C parts (stallwatch/correlator/_kernels.c: the correlator's hottest loops), optional: without a C
compiler and Python's headers, or with `STALLWATCH_AGENT_PURE=1`, the correlator runs their NumPy versions, with
the same results. Everything else is pyproject.toml's."""

import os

from setuptools import Extension, setup

KERNELS = Extension("stallwatch.correlator._kernels", ["stallwatch/correlator/_kernels.c"], optional=True)

setup(ext_modules=[] if os.environ.get("STALLWATCH_AGENT_PURE") == "1" else [KERNELS])
