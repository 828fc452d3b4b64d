"""The host tier's RSS stays inside what it charges the budget (issue 38, 2.5): a page costs its
bytes and its bookkeeping (`PAGE_BOOKKEEPING_BYTES`: tensor object, allocation header, entries,
hash), so many small pages cannot take the process past `--preempt-ram`.

Measured in a fresh interpreter: the tier is filled with 20,000 small pages (256 bytes, where
the bookkeeping is most of a page), each written as a copy would write it, and the growth of
VmRSS is held to the bytes the store says it holds. Charging the bytes alone let RSS grow to
about four times that.
"""

from __future__ import annotations

import json
import subprocess
import sys

SLACK_BYTES = 1 << 20  # the interpreter's own arenas, touched while filling
SCRIPT = r"""
import hashlib, json, torch
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.host_tier import HostTier
from kvpark.pod.memory.prefix_cache import Evicted

class Copy:  # writes every byte, as a copy from the pool does
    def save(self, pages, buffers):
        for buffer in buffers:
            buffer.fill_(1.0)

def rss():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmRSS:"))

store = HostStore(-1)
tier = HostTier(store, Copy(), (1, 2, 4, 1, 8), torch.float32)
batch = 500
hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(20000)]
before = rss()
for start in range(0, len(hashes), batch):
    tier.keep([Evicted(i, h, start + i) for i, h in enumerate(hashes[start:start + batch])])
print(json.dumps({"pages": tier.num_pages, "held": store.held_bytes, "grew": rss() - before}))
"""


def test_the_tiers_rss_stays_inside_what_it_charges():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    measured = json.loads(out.stdout)
    assert measured["pages"] == 20000
    assert measured["grew"] <= measured["held"] + SLACK_BYTES, (
        f"RSS grew {measured['grew']} B for {measured['pages']} pages charged "
        f"{measured['held']} B: {(measured['grew'] - measured['held']) / measured['pages']:.0f} "
        "B a page uncharged")
