"""Which pages the pool holds free and which the prefix cache holds cached, read from their own
lists, for tests that check every page is in exactly one place (the serving code needs only
the counts)."""

from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.prefix_cache import PrefixCache


def free_page_ids(pool: KVPool) -> list[int]:
    return sorted(pool._free)


def cached_page_ids(cache: PrefixCache) -> list[int]:
    return list(cache._lru)
