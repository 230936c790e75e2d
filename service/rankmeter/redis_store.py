"""The state store on Redis (or Redis Cluster): one hash tag per partition.

Keys, with prefix P and partition p (all of p's keys hash to one slot):

    P:{P:p}:q:<query id>   string   the encoded QueryRecord, with a TTL
    P:{P:p}:open           zset     query id -> deadline (ms), for closing and orphans
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
                pipe.mget([self._key(p, f"q:{q}") for q in qids])  # one slot per MGET
            results = pipe.execute()
        return dict(zip(wanted, results))

    def write(self, writes: Iterable[PartitionWrite]) -> None:
        # MULTI/EXEC per partition: each transaction touches one slot, so it works on
        # Redis Cluster too; a crash keeps a partition's state and offsets, or neither.
        for w in writes:
            with self.client.pipeline(transaction=True) as pipe:
                for q, data in w.records.items():
                    pipe.set(self._key(w.partition, f"q:{q}"), data, px=w.record_ttl_ms)
                if w.deadlines:
                    pipe.zadd(self._key(w.partition, "open"), w.deadlines)
                if w.deleted:
                    pipe.delete(*[self._key(w.partition, f"q:{q}") for q in w.deleted])
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
