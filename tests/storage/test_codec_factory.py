"""The value header codec, the namespace fingerprint, the URL factory and the optional
Mooncake backend (skipped where ``mooncake.store`` does not import)."""
from __future__ import annotations

import os

import pytest

from fastkv.storage import Verdict, mooncake_store, namespace_fingerprint, open_store, parse_size
from fastkv.storage.base import HEADER_BYTES, ValueCodec
from fastkv.storage.lmdb_store import LMDBStore

from .conftest import NS, NS_OTHER, rand_keys


def test_header_layout_and_verdicts():
    codec = ValueCodec(NS, 1, 4)
    key = rand_keys(1)[0]
    payload = memoryview(os.urandom(100))
    value = codec.header(key, payload) + payload
    assert len(value) == HEADER_BYTES + 100
    assert value[:4] == b"FKVB" and value[24:56] == NS and value[56:88] == key
    assert int.from_bytes(value[16:24], "little") == 100
    assert codec.verify(key, value, 100) is Verdict.OK
    assert codec.verify(key, value[:HEADER_BYTES - 1], 100) is Verdict.SHORT
    assert codec.verify(key, value, 99) is Verdict.LENGTH
    assert codec.verify(rand_keys(1)[0], value, 100) is Verdict.KEY
    assert ValueCodec(NS_OTHER, 1, 4).verify(key, value, 100) is Verdict.NAMESPACE
    assert ValueCodec(NS, 2, 4).verify(key, value, 100) is Verdict.RANK
    flipped = bytearray(value)
    flipped[100] ^= 1  # reserved header byte: covered by the checksum
    assert codec.verify(key, flipped, 100) is Verdict.CHECKSUM


def test_namespace_fingerprint_is_unambiguous():
    assert namespace_fingerprint("ab", "c") != namespace_fingerprint("a", "bc")
    assert namespace_fingerprint("m", b"x") == namespace_fingerprint(b"m", "x")
    assert len(namespace_fingerprint("m")) == 32


def test_parse_size():
    assert parse_size("1024") == 1024
    assert parse_size("64G") == 64 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2k") == 2048
    with pytest.raises(ValueError, match="not a size"):
        parse_size("1.5G")


def test_lmdb_url(tmp_path):
    store = open_store(f"lmdb://{tmp_path}/e?max_bytes=2M&map_size=64M", NS, 0, 1)
    assert isinstance(store, LMDBStore) and store.max_bytes == 2 << 20
    store.close()
    for bad, match in [(f"lmdb://{tmp_path}?max_bytes=lots", "max_bytes"), ("lmdb://", "directory"),
                       (f"lmdb://{tmp_path}?size=1G", "unknown option"), ("s3://bucket", "scheme"),
                       (f"lmdb://{tmp_path}?max_bytes=2M&map_size=1M", "map_size")]:
        with pytest.raises(ValueError, match=match):
            open_store(bad, NS)
    with pytest.raises(TypeError):
        open_store(None, NS)


def test_mooncake_missing_is_a_clear_import_error(monkeypatch):
    monkeypatch.setattr(mooncake_store, "MooncakeDistributedStore", None)  # as where it is not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[mooncake\]'"):
        open_store("mooncake://127.0.0.1:50051?metadata_server=P2PHANDSHAKE&local_hostname=127.0.0.1", NS)
