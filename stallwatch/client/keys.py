"""The key of a dataset read, shared by the training client and the spoke collectors.

A read is named by its resource (a file path, or a URL's path without scheme, host or query) and
its byte offset, hashed to 64 bits: both sides of the cache compute the same key, so the correlator
can join a worker's read to the spoke's log line without ever carrying a path as a label. The
resource is hashed alone (`resource_hash`) and the offset mixed in after (`key_at`), so a file read
in many pieces hashes its path once, not once a read.
Standard library only: the training client imports this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from urllib.parse import urlsplit

MASK = (1 << 64) - 1  # keys are 64 bits: sums and products wrap as in C

_hash_in_c: Callable[[str, int], int] | None
try:  # the same hash in C where the client was built with it: ~0.6 µs less a key
    from stallwatch.client._speedups import read_key as _hash_in_c
except ImportError:
    _hash_in_c = None


def resource_of(location: str) -> str:
    """`http://spoke:8080/shards/0001.tar?x=1` -> `/shards/0001.tar`; a file path stays as it is."""
    if "://" in location:
        return urlsplit(location).path or "/"
    return location


def read_key(location: str, offset: int = 0) -> int:
    resource = resource_of(location)
    if _hash_in_c is not None:
        try:
            return _hash_in_c(resource, offset)
        except (TypeError, OverflowError):  # not a str and an int of 64 bits: hashed in Python, alike
            pass
    return hash_in_python(resource, offset)


def hash_in_python(resource: str, offset: int) -> int:
    return key_at(resource_hash(resource), offset)


def resource_hash(resource: str) -> int:
    """The first 8 bytes of BLAKE2b-64 of the resource's UTF-8, little-endian."""
    return int.from_bytes(hashlib.blake2b(resource.encode(), digest_size=8).digest(), "little")


def key_at(resource_hash: int, offset: int) -> int:
    """The key of a read at `offset` of a resource: splitmix64's finalizer of `resource_hash + offset` modulo
    2^64. The finalizer is a bijection, so keys collide only as often as any 64-bit hash's, and neighbouring
    offsets of one file get unrelated keys."""
    z = (resource_hash + offset) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def range_start(text: str) -> int:
    """`bytes=1048576-2097151` -> 1048576, the offset a ranged read is keyed by; anything else (no Range, a
    suffix range) -> 0."""
    unit, _, spec = text.partition("=")
    first = spec.split(",", 1)[0].split("-", 1)[0].strip()
    return int(first) if unit.strip() == "bytes" and first.isdigit() else 0
