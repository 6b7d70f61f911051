"""Copy tasks, the per-rank cache-transfer process, and the engine-side client.

* ``tiers``: the KV tiers of a rank shared between processes (shm + DLPack, CUDA IPC).
* ``protocol``: what travels on a task channel besides copy tasks (the FENCE), and the
  storage namespace fingerprint.
* ``executor``: runs one task on a rank's tiers and storage backend (CLEAR/RESTORE meaning).
* ``process``: ``main(spec_json, rank)``, the transfer process's loop.
* ``client``: ``TransferClient`` and ``CopyResult``, the engine's side.
"""
