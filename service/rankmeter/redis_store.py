"""The state store on Redis (or Redis Cluster): one hash tag per partition.

A batch costs a handful of commands per partition whatever its size: records live in
one hash per partition (one HMGET to read, one HSET to write) rather than a key each,
since redis-py spends more on packing a command than Redis spends running it. Records
expire through the `open` deadlines, swept by the pipeline, instead of key TTLs.

Keys, with prefix P and partition p (all of p's keys hash to one slot):

    P:{P:p}:queries        hash     query id -> the encoded QueryRecord
    P:{P:p}:open           zset     query id -> deadline (ms); past it the query is closed
                                    (or orphaned) and its record deleted
    P:{P:p}:buckets        hash     ranker␟segment␟minute -> encoded window sums
    P:{P:p}:offsets        hash     topic -> next offset to read
    P:labels:<kind>        set      the label values admitted so far (rankers, segments)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis

from rankmeter.store import PartitionSnapshot, PartitionWrite

# Admits a label value while fewer than the cap are known; atomic across replicas.
_ADMIT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('SADD', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


class RedisStore:
    def __init__(self, url: str, prefix: str = "rankmeter") -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)
        self.prefix = prefix
        self._admit = self.client.register_script(_ADMIT)

    def _key(self, partition: int, name: str) -> str:
        return f"{self.prefix}:{{{self.prefix}:{partition}}}:{name}"

    def ping(self) -> bool:
        return bool(self.client.ping())

    def partitions(self) -> list[int]:
        """The partitions with stored state (for `rankmeter report`)."""
        pattern = f"{self.prefix}:{{{self.prefix}:*}}:offsets"
        found = {int(key.decode().split(":")[-2].rstrip("}")) for key in self.client.scan_iter(match=pattern)}
        return sorted(found)

    def load(self, partition: int) -> PartitionSnapshot:
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._key(partition, "offsets"))
            pipe.hgetall(self._key(partition, "buckets"))
            offsets, buckets = pipe.execute()
        return PartitionSnapshot({k.decode(): int(v) for k, v in offsets.items()},
                                 {k.decode(): v for k, v in buckets.items()})

    def read(self, wanted: Mapping[int, list[str]]) -> dict[int, list[bytes | None]]:
        with self.client.pipeline(transaction=False) as pipe:
            for p, qids in wanted.items():
                pipe.hmget(self._key(p, "queries"), qids)
            results = pipe.execute()
        return dict(zip(wanted, results))

    def write(self, writes: Iterable[PartitionWrite]) -> None:
        # MULTI/EXEC per partition: each transaction touches one slot, so it works on
        # Redis Cluster too; a crash keeps a partition's state and offsets, or neither.
        for w in writes:
            with self.client.pipeline(transaction=True) as pipe:
                if w.records:
                    pipe.hset(self._key(w.partition, "queries"), mapping=w.records)
                if w.deadlines:
                    pipe.zadd(self._key(w.partition, "open"), w.deadlines)
                if w.deleted:
                    pipe.hdel(self._key(w.partition, "queries"), *w.deleted)
                    pipe.zrem(self._key(w.partition, "open"), *w.deleted)
                if w.buckets:
                    pipe.hset(self._key(w.partition, "buckets"), mapping=w.buckets)
                if w.dropped_buckets:
                    pipe.hdel(self._key(w.partition, "buckets"), *w.dropped_buckets)
                if w.offsets:
                    pipe.hset(self._key(w.partition, "offsets"), mapping=w.offsets)
                pipe.execute()

    def expired(self, partitions: Iterable[int], now_ms: int) -> dict[int, tuple[list[str], int]]:
        partitions = list(partitions)
        with self.client.pipeline(transaction=False) as pipe:
            for p in partitions:
                pipe.zrangebyscore(self._key(p, "open"), "-inf", now_ms)
                pipe.zcard(self._key(p, "open"))
            results = pipe.execute()
        return {p: ([q.decode() for q in results[2 * i]], results[2 * i + 1])
                for i, p in enumerate(partitions)}

    def admit_label(self, kind: str, value: str, cap: int) -> bool:
        return bool(self._admit(keys=[f"{self.prefix}:labels:{kind}"], args=[value, cap]))

    def close(self) -> None:
        self.client.close()
