"""Pure: which of the operator's replicas works. kopf's peering (`kopf run --peering`) pauses every
replica but the one with the highest priority; each replica draws a random priority at start
(`__main__.py`), so exactly one works and another takes over when its keep-alives stop (after
`LIFETIME_SECONDS`). kopf pauses its own watches; the operator's resync loop is not kopf's, so it
asks `is_leader` each round with the peering objects' status.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

GROUP_VERSION = "kopf.dev/v1"
MAX_PRIORITY = 2**31 - 1  # kopf stores it in a JSON number; a draw tie is 1 in 2**31


def get_paths(name: str, namespaces: Iterable[str]) -> list[str]:
    """The peering objects kopf keeps: one ClusterKopfPeering for an operator of all namespaces,
    else a KopfPeering in each watched namespace."""
    namespaces = list(namespaces)
    if not namespaces:
        return [f"/apis/{GROUP_VERSION}/clusterkopfpeerings/{name}"]
    return [f"/apis/{GROUP_VERSION}/namespaces/{ns}/kopfpeerings/{name}" for ns in namespaces]


def get_objects(name: str, namespaces: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
    """The peering objects to create where missing: (collection path, body) each. kopf pauses
    every replica while its peering object is absent, so the operator makes its own and one
    `kubectl apply -f manifests/` (whose peering CRDs are not served yet while it runs) needs
    no second pass."""
    objects = []
    for path in get_paths(name, namespaces):
        collection, _, _ = path.rpartition("/")
        namespace = path.split("/namespaces/")[1].split("/")[0] if "/namespaces/" in path else ""
        kind = "KopfPeering" if namespace else "ClusterKopfPeering"
        metadata = {"name": name, "labels": {"app.kubernetes.io/name": "kvpark-operator",
                                             "app.kubernetes.io/part-of": "kvpark"},
                    **({"namespace": namespace} if namespace else {})}
        objects.append((collection, {"apiVersion": GROUP_VERSION, "kind": kind,
                                     "metadata": metadata}))
    return objects


def parse_time(text: str) -> datetime.datetime:
    parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)


def get_live_priorities(status: Mapping[str, Any], now: datetime.datetime) -> list[int]:
    """Priorities of the peers whose keep-alive has not expired (kopf's Peer.is_dead)."""
    live = []
    for peer in status.values():
        if not isinstance(peer, Mapping) or "lastseen" not in peer:
            continue
        deadline = parse_time(peer["lastseen"]) + datetime.timedelta(
            seconds=int(peer.get("lifetime", 60)))
        if deadline > now:
            live.append(int(peer.get("priority", 0)))
    return live


def is_leader(peerings: Iterable[Mapping[str, Any] | None], priority: int,
              now: datetime.datetime) -> bool:
    """As kopf decides it: no live peer has a higher priority, and none shares ours (kopf then
    pauses both). Our own entry is the one with our priority. A missing peering object makes
    kopf pause (peering is mandatory), and so does this."""
    for peering in peerings:
        if peering is None:
            return False
        live = get_live_priorities(peering.get("status") or {}, now)
        if any(p > priority for p in live) or live.count(priority) > 1:
            return False
    return True
