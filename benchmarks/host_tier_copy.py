"""What keeping evicted pages in the host tier costs the step that evicts them, on this machine.

    python benchmarks/host_tier_copy.py --rounds 12

A `KVPool` with SmolLM2-135M's shapes (30 layers, 3 KV heads of 64, fp32 KV, 16-token pages)
fills its prefix cache, then one `allocate(N)` evicts N cached pages: with the host tier each is
copied to host RAM before the allocation returns, without it nothing is. The two alternate
round by round (a shared machine moves both alike); medians, and the cost per page.
"""

from __future__ import annotations

import argparse
import statistics
import time

from workload import print_table, write_json

from kvpark.kernels.kv_copy import SyncCopyEngine
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.host_tier import HostTier
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.prefix_cache import PrefixCache

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE, NUM_PAGES = 30, 3, 64, 16, 512


class EvictingPool:
    """A pool whose every page is cached (registered, held by nobody) before each round."""

    def __init__(self, host_tier: bool) -> None:
        self.cache = PrefixCache("bench", PAGE_SIZE)
        self.pool = KVPool(LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, cache=self.cache)
        if host_tier:
            self.pool.tier = HostTier(HostStore(-1), SyncCopyEngine(self.pool),
                                      self.pool.host_page_shape, self.pool.dtype)
        self.serial = 0

    def fill_cache(self) -> None:
        self.pool.drop_cached(list(range(NUM_PAGES)))
        pages = self.pool.allocate(self.pool.num_free_pages)
        for page in pages:
            self.serial += 1
            self.cache.register(page, self.serial.to_bytes(8, "little"))
        self.pool.free(pages)

    def evict(self, num_pages: int) -> float:
        self.fill_cache()
        started = time.perf_counter()
        pages = self.pool.allocate(num_pages)
        seconds = time.perf_counter() - started
        self.pool.free(pages)
        return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--pages", type=int, nargs="+", default=[1, 32])
    p.add_argument("--out", default="benchmarks/results/host_tier_copy.json")
    args = p.parse_args()
    pools = {"tier off": EvictingPool(False), "tier on": EvictingPool(True)}
    page_mib = LAYERS * 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM * 4 / 2**20
    rows, results = [], {}
    for num_pages in args.pages:
        times: dict[str, list[float]] = {name: [] for name in pools}
        for _ in range(args.rounds):
            for name, pool in pools.items():  # alternating
                times[name].append(pool.evict(num_pages))
        off, on = (statistics.median(times[n]) for n in ("tier off", "tier on"))
        results[num_pages] = {"off_ms": off * 1e3, "on_ms": on * 1e3}
        rows.append([num_pages, f"{off * 1e3:.3f}", f"{on * 1e3:.3f}",
                     f"{(on - off) * 1e3 / num_pages:.3f}"])
    print(f"pages of {page_mib:.2f} MiB (SmolLM2-135M, fp32 KV, {PAGE_SIZE} tokens)")
    print_table(["pages evicted", "tier off ms", "tier on ms", "ms a page"], rows)
    write_json(args.out, {"args": vars(args), "page_mib": page_mib, "results": results})


if __name__ == "__main__":
    main()
