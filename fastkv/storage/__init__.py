"""Storage tier: backend interface, embedded LMDB store, distributed Redis store.

``open_store(url, namespace, rank, tp_size)`` builds a backend; see base.py for the
interface and the value format every backend stores.
"""
from fastkv.storage.base import StorageBackend, StoreStats, Verdict, namespace_fingerprint
from fastkv.storage.factory import open_store, parse_size, probe_store

__all__ = ["StorageBackend", "StoreStats", "Verdict", "namespace_fingerprint", "open_store", "parse_size",
           "probe_store"]
