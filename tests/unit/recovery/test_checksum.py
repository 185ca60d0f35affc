"""Checksums of shards: the algorithm travels with the value."""

from __future__ import annotations

import zlib

import pytest

from matrixpool_recovery import checksum, errors


def test_xxh3_is_the_default_and_crc32_matches_zlib() -> None:
    assert checksum.DEFAULT == checksum.XXH3
    assert checksum.of(b"hello", checksum.CRC32) == f"crc32:{zlib.crc32(b'hello'):08x}"


def test_a_running_checksum_equals_the_one_shot_one() -> None:
    running = checksum.Running()
    for piece in (b"he", b"ll", b"o"):
        running.update(piece)
    assert running.value == checksum.of(b"hello")
    checksum.verify(checksum.of(b"hello"), running, "hello")


def test_a_mismatch_names_both_values() -> None:
    running = checksum.Running()
    running.update(b"hellp")
    with pytest.raises(errors.IntegrityError, match="!= recorded"):
        checksum.verify(checksum.of(b"hello"), running, "hello")


@pytest.mark.parametrize("value", ["", "xxh3_64", "xxh3_64:", "md5:abc"], ids=repr)
def test_malformed_or_unknown_checksums_are_integrity_errors(value: str) -> None:
    with pytest.raises(errors.IntegrityError):
        checksum.Running(checksum.algorithm_of(value))
