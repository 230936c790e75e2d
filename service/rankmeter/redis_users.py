"""The arms' distinct-user HyperLogLogs in Redis (`ab.unit: user`, pipeline/users.py).

    P:{P:p}:users:<experiment>␟<ranker>␟<segment>   one HyperLogLog per arm and partition

The partition's hash tag, so its commit script PFADDs into them with its other keys (one
slot on Redis Cluster). A look reads them with GET, not PFCOUNT: the partitions' keys are in
different slots, and PFCOUNT of several keys needs one (ab/hll.py merges them instead).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis
from redis.cluster import RedisCluster


def key(prefix: str, partition: int, arm: str) -> str:
    return f"{prefix}:{{{prefix}:{partition}}}:users:{arm}"


def arms(fields: Iterable[bytes]) -> list[str]:
    """The arms (experiment␟ranker␟segment) of a partition's stored A/B sums fields."""
    return sorted({"\x1f".join(f.decode(errors="replace").split("\x1f")[:3]) for f in fields})


def load(client: redis.Redis | RedisCluster, prefix: str, wanted: Mapping[int, list[str]]) -> dict[int, dict[str, bytes]]:
    with client.pipeline(transaction=False) as pipe:
        for p, names in wanted.items():
            for arm in names:
                pipe.get(key(prefix, p, arm))
        replies = pipe.execute(raise_on_error=False)
    for reply in replies:  # a connection or cluster error fails the look (the next one retries)
        if isinstance(reply, Exception) and not str(reply).startswith("WRONGTYPE"):
            raise reply
    found = iter(replies)
    # Another type's value (WRONGTYPE) is not a count: b"", which the look skips as unreadable.
    return {p: {arm: data if isinstance(data, bytes) else b"" for arm in names if (data := next(found)) is not None}
            for p, names in wanted.items()}
