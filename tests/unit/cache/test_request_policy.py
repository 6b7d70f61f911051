"""A request's cache policy in the cache manager: a request that may not write leaves no key, no
copy and no stored event behind; a read filter cuts its prefix match at the first tier it may
not read; the public forms parse, and bad ones name the field and the tier."""
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.cache.request_policy import CachePolicy
from fastkv.cache.residency import ResidencyLog
from fastkv.cache.write_policy import Tier, WritePolicy
from tests.unit.cache.test_manager import BS, drain, mk, run_prompt, toks

NO_WRITE = CachePolicy.of(False)


def test_public_forms_and_their_errors():
    assert CachePolicy.of(None) is None and CachePolicy.of(True) is None
    assert CachePolicy.of({"read": ["storage", "host", "device"]}) is None  # every tier: the default
    assert NO_WRITE == CachePolicy.of({"write": []}) and not NO_WRITE.write
    assert CachePolicy.of({"read": ["device", "storage"]}).readable == (Tier.DEVICE,)
    for bad, says in (({"read": ["gpu"]}, "cache.read: unknown tier 'gpu'"),
                      ({"write": ["device"]}, "cache.write ['device']: a request writes every tier"),
                      ({"load": []}, "cache has unknown keys ['load']"),
                      ({"read": "device"}, "cache.read must be a list"),
                      ("none", "cache must be true, false or")):
        with pytest.raises(ValueError) as exc:
            CachePolicy.of(bad)
        assert str(exc.value).startswith(says), str(exc.value)


def test_a_request_that_may_not_write_leaves_no_key_copy_or_event():
    m = mk(dev=8, host=8, storage=True, policy=WritePolicy.WRITE_THROUGH)
    log = m.watch_residency(ResidencyLog())
    run_prompt(m, "shared", toks(1, 2))
    log.take()
    t = toks(1, 2, 3, 4, extra=1)
    a = m.allocate("a", t, policy=NO_WRITE)
    assert a.num_cached_tokens == 2 * BS  # it reads what others cached
    assert m.mark_computed("a", len(t)) == []  # no write-through, so no STORE either
    m.free("a")
    m.check_integrity()
    own = set(m.keys_for(t)[2:])
    assert not own & (set(m.device.lookup) | set(m.host.lookup) | set(m.index.stored))
    _, changes = log.take()
    assert not [k for ch in changes for k, _ in ch.stored], "a stored event for a request that may not write"
    assert m.allocate("b", t).num_cached_tokens == 2 * BS  # its own blocks were freed, not cached


def test_a_read_filter_cuts_the_match_at_the_first_tier_it_may_not_read():
    m = mk(dev=3, host=8, storage=True, policy=WritePolicy.WRITE_THROUGH)
    m.allocate("a", toks(1, 2, extra=1))
    drain(m, m.mark_computed("a", 2 * BS + 1))
    m.free("a")
    run_prompt(m, "b", toks(5, 6, 7))  # a's blocks leave the device: the host and storage hold them
    t = toks(1, 2, extra=1)
    assert m.match(t).host_blocks and not m.match(t, policy=CachePolicy.of({"read": ["device"]})).host_blocks
    d = m.allocate("d", t, policy=CachePolicy.of({"read": ["device"]}))
    assert d.num_pending_tokens == 0 and not [p for p in d.plans if p.kind is CopyKind.SWAP_IN]
    m.free("d")
    m.reset_prefix_cache()  # storage alone keeps a's blocks now
    m.confirm_stored(m.keys_for(t))
    assert m.match(t).storage_keys
    e = m.allocate("e", t, policy=CachePolicy.of({"read": ["device", "host"]}))
    assert e.num_pending_tokens == 0 and not [p for p in e.plans if p.kind is CopyKind.LOAD]
    m.free("e")
    m.check_integrity()
