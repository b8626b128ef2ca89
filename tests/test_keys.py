"""A read's key (`stallwatch.client.keys.read_key`): the client and the spoke collectors must compute the same
64 bits for the same resource and offset, whether the client hashes in C (`_speedups`) or in Python."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stallwatch.client import keys

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def reference_key(resource: str, offset: int) -> int:
    """The key as the wire defines it: BLAKE2b-64 of the resource from hashlib, plus the offset modulo 2^64,
    through splitmix64's finalizer (its constants as its authors publish them)."""
    z = int.from_bytes(hashlib.blake2b(resource.encode(), digest_size=8).digest(), "little") + offset
    for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z %= 2**64
        z = (z ^ (z >> shift)) * multiplier
    z %= 2**64
    return z ^ (z >> 31)


def c_hash() -> object:
    if keys._hash_in_c is None:
        pytest.skip("the client was built without its C parts")
    return keys._hash_in_c


@settings(max_examples=300, deadline=None)
@given(location=st.text(max_size=300), offset=st.one_of(INT64, st.integers()))
@example(location="http://spoke:8080/data/a.bin?x=1", offset=100)
def test_a_key_is_the_resources_blake2b_mixed_with_the_offset(location: str, offset: int) -> None:
    try:
        expected = reference_key(keys.resource_of(location), offset)
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8, no key, either way
        with pytest.raises(UnicodeEncodeError):
            keys.read_key(location, offset)
        return
    assert keys.read_key(location, offset) == expected


@pytest.mark.parametrize("length", [0, 1, 118, 119, 120, 127, 128, 129, 246, 247, 248, 255, 256, 257, 511, 512, 513])
def test_the_c_hash_is_the_reference_at_every_block_boundary_of_blake2b(length: int) -> None:
    hash_in_c = c_hash()
    for resource in ("a" * length, "\u00e9" * length, "\u4e2d" * (length // 3)):
        for offset in (0, 7, 4096, 2**63 - 1, -(2**63)):
            assert hash_in_c(resource, offset) == reference_key(resource, offset)  # type: ignore[operator]


def test_the_c_hash_leaves_what_it_does_not_take_to_python() -> None:
    """An offset past 64 bits or not an int, a str subclass: read_key hashes them in Python, alike."""
    hash_in_c = c_hash()

    class Path(str):
        pass

    for resource, offset in ((Path("/data/a"), 0), ("/data/a", 2**64), ("/data/a", True)):
        with pytest.raises((TypeError, OverflowError)):
            hash_in_c(resource, offset)  # type: ignore[operator]
        assert keys.read_key(resource, offset) == keys.hash_in_python(resource, offset)
