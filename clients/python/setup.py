"""The client's C parts (stallwatch/client/_speedups.c: read capture's open() hook and raw readinto, a read's
key), optional: a wheel built with them is for its platform; without a C compiler and Python's headers, or
with `STALLWATCH_CLIENT_PURE=1` (`make dist`'s wheel for any platform), the client is Python alone, with the
same rules. Everything else is pyproject.toml's."""

import os

from setuptools import Extension, setup

SPEEDUPS = Extension("stallwatch.client._speedups", ["stallwatch/client/_speedups.c"], optional=True)

setup(ext_modules=[] if os.environ.get("STALLWATCH_CLIENT_PURE") == "1" else [SPEEDUPS])
