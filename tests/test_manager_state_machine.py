"""KVCacheManager under every interleaving of its operations, against a reference model."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from kvmem.manager import KVCacheManager
from kvmem.testing import ManagerMachine

SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class HashedCacheMachine(ManagerMachine):
    pass


class NoReuseMachine(ManagerMachine):
    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_pages=self.num_pages, page_size=self.page_size,
                              max_seqs=self.max_seqs, max_pages_per_seq=self.max_pages_per_seq,
                              prefix_cache=None, tracker="paranoid", watermark=0.0)


class RoomyMachine(ManagerMachine):
    """Enough pages that nothing is evicted: every prefix hit must be exact."""

    num_pages = 96


TestHashedCache = HashedCacheMachine.TestCase
TestHashedCache.settings = SETTINGS
TestNoReuse = NoReuseMachine.TestCase
TestNoReuse.settings = settings(SETTINGS, max_examples=25)
TestRoomy = RoomyMachine.TestCase
TestRoomy.settings = settings(SETTINGS, max_examples=30)
