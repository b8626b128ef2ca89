"""The client's C hook for `open()` (stallwatch/client/_speedups.c, read capture's refusals), optional: a
wheel built with it is for its platform; without a C compiler and Python's headers, or with
`STALLWATCH_CLIENT_PURE=1` (`make dist`'s wheel for any platform), the client is Python alone and read
capture installs its hook written in Python. Everything else is pyproject.toml's."""

import os

from setuptools import Extension, setup

HOOK = Extension("stallwatch.client._speedups", ["stallwatch/client/_speedups.c"], optional=True)

setup(ext_modules=[] if os.environ.get("STALLWATCH_CLIENT_PURE") == "1" else [HOOK])
