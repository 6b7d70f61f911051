"""The tp collective: correct data in rank order, rounds kept apart, timeouts named, nothing leaked."""
from __future__ import annotations

import os
import stat
import threading

import numpy as np
import pytest

from fastkv.ipc.collective import ShmCollective
from tests.conftest import shm_test_name


def prefix():
    return shm_test_name()


def run_ranks(name, world, fn, timeout_s=10.0):
    """Run fn(handle) on ``world`` threads, one attached handle each; return results by rank."""
    results, errors = [None] * world, []

    def body(rank):
        try:
            with ShmCollective.attach(name, rank, timeout_s=timeout_s) as c:
                results[rank] = fn(c)
        except BaseException as e:  # reported to the test below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_gather_and_reduce_over_many_rounds_and_chunked_payloads(world):
    name = prefix()
    with ShmCollective.create(name, world, slot_bytes=40):  # tiny slots: most payloads take several rounds

        def work(c):
            got = []
            for i in range(30):
                n = (i * 7) % 23
                arr = np.arange(n, dtype=np.float64) * (c.rank + 1) + i
                got.append(c.all_gather(arr))
                got.append(c.all_reduce_sum(arr.reshape(1, n)))
                if i % 5 == 0:
                    c.barrier()
            return got

        results = run_ranks(name, world, work)
    for rank in range(world):
        for i in range(30):
            n = (i * 7) % 23
            parts, total = results[rank][2 * i], results[rank][2 * i + 1]
            want = [np.arange(n, dtype=np.float64) * (j + 1) + i for j in range(world)]
            assert len(parts) == world and all(np.array_equal(p, w) for p, w in zip(parts, want, strict=True))
            np.testing.assert_array_equal(total, sum(want).reshape(1, n))


def test_mismatched_sizes_are_a_value_error():
    name = prefix()
    with ShmCollective.create(name, 2):
        with pytest.raises(ValueError, match=r"all_gather: rank \d sent (8|16) bytes, rank \d (16|8)"):
            run_ranks(name, 2, lambda c: c.all_gather(np.zeros(c.rank + 1)))


def test_a_missing_peer_times_out_naming_it():
    name = prefix()
    with ShmCollective.create(name, 2), ShmCollective.attach(name, 0, timeout_s=0.2) as c:
        with pytest.raises(TimeoutError, match="rank 0 waited .* for rank 1"):
            c.all_gather(np.zeros(3))


def test_objects_are_private_and_removed_at_close():
    name = prefix()
    owner = ShmCollective.create(name, 2)
    files = ["/dev/shm/" + n.lstrip("/") for n in ShmCollective.names(name, 2)[:1]]
    files += ["/dev/shm/sem." + n.lstrip("/") for n in ShmCollective.names(name, 2)[1:]]
    assert len(files) == 3
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    owner.close()
    owner.close()  # idempotent
    assert not any(os.path.exists(f) for f in files)


def test_crash_leftovers_are_unlinked_and_recreated():
    name = prefix()
    ShmCollective.create(name, 2)  # never closed: a crashed creator
    assert ShmCollective.unlink(name, 2) == 3
    assert ShmCollective.unlink(name, 2) == 0
    ShmCollective.create(name, 2)  # a crashed creator again: create replaces the leftovers
    with ShmCollective.create(name, 2) as c:
        assert c.world_size == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="fkv"):
        ShmCollective.create("notfkv", 2)
    with pytest.raises(FileNotFoundError, match="create it before attaching"):
        ShmCollective.attach(prefix(), 0)
    name = prefix()
    with ShmCollective.create(name, 2) as owner:
        with pytest.raises(ValueError, match="rank must be in"):
            ShmCollective.attach(name, 2)
        with pytest.raises(ValueError, match="does not take part"):
            owner.all_gather(np.zeros(1))
