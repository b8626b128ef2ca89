"""stallwatch: is the GPU starving on remote data read through a cache, and why."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("stallwatch")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0.0.0"
