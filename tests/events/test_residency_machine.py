"""Property test: under every cache operation the manager machine drives (allocations, prefix
hits, write-through and write-back, offload and restore, loads, stores, failed copies, lost
storage keys, frees mid-copy, weight updates), a subscriber applying the residency log's changes
after each step holds exactly each tier's chained keys: the maps' keys less private ones."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from fastkv.cache.residency import ResidencyLog
from fastkv.cache.write_policy import Tier
from tests.stateful.test_manager_machine import ManagerMachine


class ResidencyMachine(ManagerMachine):
    @rule(go=st.integers(0, 4))
    def reset_prefix_cache(self, go):
        if go:  # now and then: it drops what the other rules build up
            return
        # every key it drops is lost: held children of dropped cached parents are stranded, by design
        self.lost |= set(self.m.device.lookup) | set(self.m.host.lookup) | set(self.m.index.stored)
        self.m.reset_prefix_cache()

    @invariant()
    def subscriber_holds_each_tiers_chained_keys(self):
        if not hasattr(self, "m"):
            return
        if not hasattr(self, "log"):  # first check: right after setup, before any rule
            assert not self.m.device.lookup and not self.m.host.lookup and not self.m.index.stored
            self.log = self.m.watch_residency(ResidencyLog())
            self.mirror = {t: set() for t in Tier}
        clears, changes = self.log.take()
        if clears:
            for keys in self.mirror.values():
                keys.clear()
        for ch in changes:
            keys = self.mirror[ch.tier]
            assert not keys & {k for k, _ in ch.stored}, f"{ch.tier.name}: a key announced twice"
            assert set(ch.removed) <= keys, f"{ch.tier.name}: removal of a key never announced"
            keys.difference_update(ch.removed)
            keys.update(k for k, _ in ch.stored)
        m = self.m
        maps = {Tier.DEVICE: m.device.lookup, Tier.HOST: m.host.lookup, Tier.STORAGE: m.index.stored}
        for t, mp in maps.items():
            want = {k for k in mp if k not in self.private}
            assert self.mirror[t] == want, (f"{t.name}: subscriber {len(self.mirror[t])} keys, tier {len(want)}: "
                                            f"{len(self.mirror[t] - want)} extra, {len(want - self.mirror[t])} missing")


def test_residency_log_mirrors_every_tier_under_the_manager_machine():
    run_state_machine_as_test(ResidencyMachine, settings=settings(max_examples=150, stateful_step_count=40,
                                                                  deadline=None))
