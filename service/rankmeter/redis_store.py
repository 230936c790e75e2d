"""The state store on Redis (or Redis Cluster): one hash tag per partition.

A batch costs a handful of commands per partition whatever its size: records live in
one hash per partition (one HMGET to read, one HSET to write) rather than a key each,
since redis-py spends more on packing a command than Redis spends running it. Records
close through the `open` deadlines (event time), swept by the pipeline, instead of key
TTLs. A checkpoint is one Lua script (`redis_scripts.COMMIT`), fenced by the owner's epoch.

Keys, with prefix P and partition p (all of p's keys hash to one slot):

    P:{P:p}:queries        hash     query id -> the encoded QueryRecord
    P:{P:p}:open           zset     query id -> deadline (ms); past it the query is closed
                                    (or orphaned) and its record deleted
    P:{P:p}:buckets        hash     ranker␟segment␟minute -> encoded window sums
    P:{P:p}:offsets        hash     topic -> next offset to read
    P:{P:p}:meta           hash     epoch (the owner's claim), layout (fingerprint of the
                                    buckets' layout), history (the layouts, oldest first:
                                    a record names its index), layout:<fp> (descriptions),
                                    watermark:<topic>
    P:{P:p}:ab             hash     experiment␟ranker␟segment -> cumulative arm sums (ab/sums.py)
    P:{P:p}:users:<arm>    HLL      the arm's (experiment␟ranker␟segment) distinct users, ab.unit: user
    P:ab:definition:<exp>  string   the measures the experiment's sums hold (JSON list), set once
    P:ab:running:<exp>     hash     comparison -> running minimum p and confidence-sequence bounds
    P:ab:looks:<exp>       list     one JSON line per minute: the experiment's history
    P:labels:<kind>:seen   zset     label values admitted (rankers, segments) -> last use (ms)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from rankmeter import redis_claim, redis_hashes, redis_scripts, redis_users
from rankmeter.ab import hll
from rankmeter.redis_hashes import replies, wrong_type
from rankmeter.store import FENCED, LOST, REWOUND, PartitionCheckpoint, PartitionSnapshot, Refused
from rankmeter.unreadable import Unreadable

class RedisStore:
    # A restarting Redis refuses connections, then answers LOADING (BusyLoadingError, a
    # ConnectionError); a cluster mid-failover says CLUSTERDOWN. A Redis at its maxmemory
    # (noeviction) refuses writes with OOM: nothing is written, and serve waits the same way.
    full = (redis.exceptions.OutOfMemoryError,)
    unavailable = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError, Refused, *full)

    def __init__(self, url: str, prefix: str = "rankmeter", cluster: bool = False) -> None:
        self.cluster = cluster
        self.client: redis.Redis | RedisCluster
        if cluster:
            # Each partition's keys share one hash tag, hence one slot: its MULTI/EXEC and
            # scripts run on the slot's master; multi-partition reads are split per node.
            try:
                self.client = RedisCluster.from_url(url, socket_timeout=30, socket_connect_timeout=10)
            except RedisClusterException as e:  # not a RedisError: callers report those
                raise redis.ConnectionError(str(e)) from None
        else:
            self.client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)
        self.prefix = prefix
        self._admit = self.client.register_script(redis_scripts.ADMIT)
        self._commit = self.client.register_script(redis_scripts.COMMIT)
        self._wipe = self.client.register_script(redis_scripts.WIPE)
        self._save = self.client.register_script(redis_scripts.SAVE)
        self._repair_epoch = self.client.register_script(redis_scripts.REPAIR_EPOCH)
        self._append = self.client.register_script(redis_scripts.APPEND)
        self._digest = self.client.register_script(redis_scripts.DIGEST)

    def _key(self, partition: int, name: str) -> str:
        return f"{self.prefix}:{{{self.prefix}:{partition}}}:{name}"

    def ping(self) -> bool:
        if self.cluster:
            # Every master: a partition's slot may live on any of them.
            return bool(self.client.ping(target_nodes=RedisCluster.PRIMARIES))
        if not self.client.ping():
            return False
        # A cluster node answers a plain client until the first key on another node (MOVED).
        try:
            clustered = self.client.info("cluster").get("cluster_enabled")
        except redis.ResponseError:  # INFO denied by an ACL or renamed: nothing to tell
            return True
        if clustered:
            raise redis.RedisError("this is a Redis Cluster node: set redis.cluster (RANKMETER_REDIS_CLUSTER=true)")
        return True

    def partitions(self) -> list[int]:
        """The partitions with stored state (for `rankmeter report`)."""
        pattern = f"{self.prefix}:{{{self.prefix}:*}}:offsets"
        # On a cluster SCAN must visit every master (redis-py's default for SCAN, named here).
        keys = (self.client.scan_iter(match=pattern, target_nodes=RedisCluster.PRIMARIES) if self.cluster
                else self.client.scan_iter(match=pattern))
        return sorted({int(key.decode().split(":")[-2].rstrip("}")) for key in keys})

    def claim(self, partition: int) -> PartitionSnapshot:
        return self._snapshot(partition, claim=True)

    def load(self, partition: int) -> PartitionSnapshot:
        return self._snapshot(partition, claim=False)

    def _snapshot(self, partition: int, claim: bool) -> PartitionSnapshot:
        return redis_claim.snapshot(self.client, lambda name: self._key(partition, name), self._repair_epoch, claim)

    def eviction_policy(self) -> str | None:
        return eviction_policy(self.client)

    def read(self, wanted: Mapping[int, list[str]]) -> dict[int, list[bytes | None]]:
        with self.client.pipeline(transaction=False) as pipe:
            for p, qids in wanted.items():
                pipe.hmget(self._key(p, "queries"), qids)
            results = replies(pipe, None)
        # (records of another type's key: unknown, the next checkpoint replaces the key)
        return {p: found or [None] * len(qids) for (p, qids), found in zip(wanted.items(), results)}

    def commit(self, checkpoints: Iterable[PartitionCheckpoint]) -> dict[int, str]:
        # One script per partition: its keys share a slot, so it works on Redis Cluster
        # too, and Redis runs it whole or not at all (store.PartitionCheckpoint lists the
        # steps). On one Redis the scripts go in one pipeline: one round trip per batch, not per partition
        # (each still applies or is refused on its own; the caller treats a connection lost
        # midway as every checkpoint unsure).
        calls = [(c.partition, self._commit_keys(c.partition) + [redis_users.key(self.prefix, c.partition, a)
                                                                 for a in c.users], commit_args(c))
                 for c in checkpoints]
        if self.cluster:
            outcomes = [self._commit(keys=keys, args=args) for _, keys, args in calls]
        else:
            outcomes = self._pipelined(calls)
        why = {-1: LOST, -2: REWOUND}
        return {p: why.get(outcome, FENCED) for (p, _, _), outcome in zip(calls, outcomes) if outcome != 1}

    def _pipelined(self, calls: list[tuple[int, list[str], list]]) -> list:
        def run(todo: list[int]) -> list:
            with self.client.pipeline(transaction=False) as pipe:
                for i in todo:
                    _, keys, args = calls[i]
                    pipe.evalsha(self._commit.sha, len(keys), *keys, *args)
                return pipe.execute(raise_on_error=False)

        outcomes = run(list(range(len(calls))))
        # A script unknown to Redis (restarted, or SCRIPT FLUSH) did not run: load it, run those again.
        again = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, redis.exceptions.NoScriptError)]
        if again:
            self.client.script_load(redis_scripts.COMMIT)
            for i, outcome in zip(again, run(again)):
                outcomes[i] = outcome
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
        return outcomes

    def _commit_keys(self, partition: int) -> list[str]:
        return [self._key(partition, name) for name in ("meta", "queries", "open", "buckets", "offsets", "ab")]

    def marks(self, partitions: Iterable[int]) -> dict[int, str]:
        partitions = list(partitions)
        with self.client.pipeline(transaction=False) as pipe:
            for p in partitions:
                pipe.hget(self._key(p, "meta"), "mark")
            found = replies(pipe, None)  # (a meta of another type: no mark, the claim repairs it)
        return {p: (m or b"").decode(errors="replace") for p, m in zip(partitions, found)}

    def expired(self, watermarks: Mapping[int, int], limit: int,
                unreadable: Unreadable | None = None) -> dict[int, tuple[list[str], int]]:
        return expired(self.client, self._key, watermarks, limit, unreadable)

    def wipe(self, partition: int, epoch: int | None = None) -> bool:
        # The epoch stays: the claim that asked for the wipe keeps owning the partition. The
        # arms' user counts go too (named by the arms' sums, in their slot).
        with self.client.pipeline(transaction=False) as pipe:
            fields = replies(pipe.hkeys(self._key(partition, "ab")), [])[0]  # (another type's: none)
        users = [redis_users.key(self.prefix, partition, a) for a in redis_users.arms(fields)]
        return bool(self._wipe(keys=self._commit_keys(partition) + users, args=["" if epoch is None else epoch]))

    def load_users(self, wanted: Mapping[int, list[str]]) -> dict[int, dict[str, bytes]]:
        return redis_users.load(self.client, self.prefix, wanted)

    def load_ab(self, partitions: Iterable[int], only: Collection[str] | None = None,
                without: Collection[str] = ()) -> dict[int, dict[str, bytes]]:
        partitions = list(partitions)
        return dict(zip(partitions, redis_hashes.load(self.client, [self._key(p, "ab") for p in partitions],
                                                      only, without)))

    def load_running(self, experiment: str) -> dict[str, str]:
        return text_hash(self.client, f"{self.prefix}:ab:running:{experiment}")

    def define_experiment(self, experiment: str, definition: str, replace: bool = False) -> str:
        key, pipe = f"{self.prefix}:ab:definition:{experiment}", self.client.pipeline(transaction=True)
        try:  # SETNX (SET with `replace`: of any type) then GET, one transaction (any Redis version)
            stored = (pipe.set(key, definition) if replace else pipe.setnx(key, definition)).get(key).execute()[1]
        except redis.ResponseError:  # not a string (WRONGTYPE), or a read-only replica: nothing readable
            return ""
        return "" if stored is None else stored.decode(errors="replace")

    def definition(self, experiment: str) -> str:
        try:
            stored = self.client.get(f"{self.prefix}:ab:definition:{experiment}")
        except redis.ResponseError:  # not a string (WRONGTYPE)
            return ""
        return "" if stored is None else stored.decode(errors="replace")

    def definition_digest(self, experiment: str) -> str | None:
        digest = self._digest(keys=[f"{self.prefix}:ab:definition:{experiment}"])
        return None if digest is None else digest.decode()

    def save_running(self, experiment: str, running: Mapping[str, str], epoch: int | None = None) -> bool:
        if not running:
            return True
        key = f"{self.prefix}:ab:running:{experiment}"
        if epoch is not None and not self.cluster:
            return bool(self._save(keys=[self._key(0, "meta"), key],
                                   args=[epoch, *(x for pair in running.items() for x in pair)]))
        if epoch is not None and not self._holds_0(epoch):
            return False
        write_hash(self.client, key, running)
        return True

    def append_look(self, experiment: str, line: str, keep: int, epoch: int | None = None) -> bool:
        key = f"{self.prefix}:ab:looks:{experiment}"
        if epoch is not None and not self.cluster:
            return bool(self._append(keys=[self._key(0, "meta"), key], args=[epoch, line, keep]))
        if epoch is not None and not self._holds_0(epoch):
            return False
        error = _push_trimmed(self.client, key, line, keep)
        if error is not None and wrong_type(error):
            self.client.delete(key)  # a key of another type holds nothing readable: replaced
            error = _push_trimmed(self.client, key, line, keep)
        if error is not None:
            raise error
        return True

    def _holds_0(self, epoch: int) -> bool:
        # On a cluster partition 0's metadata is in another slot than the experiment's keys:
        # no script spans both, so the epoch is checked just before the write (a claim in
        # between, one round trip, is not caught).
        with self.client.pipeline(transaction=False) as pipe:  # (a meta of another type: not held)
            return replies(pipe.hget(self._key(0, "meta"), "epoch"), None)[0] == str(epoch).encode()

    def looks(self, experiment: str) -> list[str]:
        with self.client.pipeline(transaction=False) as pipe:  # (another type's key: no looks)
            lines = replies(pipe.lrange(f"{self.prefix}:ab:looks:{experiment}", 0, -1), [])[0]
        return [line.decode(errors="replace") for line in lines]

    def admit_label(self, kind: str, value: str, cap: int, now_ms: int, idle_ms: int) -> bool:
        return bool(self._admit(keys=[f"{self.prefix}:labels:{kind}:seen"],
                                args=[value, cap, now_ms - idle_ms, now_ms]))

    def close(self) -> None:
        self.client.close()


def _push_trimmed(client: redis.Redis | RedisCluster, key: str, line: str, keep: int) -> Exception | None:
    """RPUSH then LTRIM to the last `keep`, one transaction; the first error, if any."""
    found = client.pipeline(transaction=True).rpush(key, line).ltrim(key, -keep, -1).execute(raise_on_error=False)
    return next((r for r in found if isinstance(r, Exception)), None)


def text_hash(client: redis.Redis | RedisCluster, key: str) -> dict[str, str]:
    """A hash's fields and values as text: bytes not UTF-8 are unreadable text, a key of
    another type is no fields (the next `write_hash` replaces it), not a crash."""
    try:
        found = client.hgetall(key)
    except redis.ResponseError as e:
        if not wrong_type(e):
            raise
        return {}
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in found.items()}


def write_hash(client: redis.Redis | RedisCluster, key: str, fields: Mapping[str, str]) -> None:
    """HSET, replacing a key of another type (it holds nothing readable), as SAVE does."""
    try:
        client.hset(key, mapping=dict(fields))
    except redis.ResponseError as e:
        if not wrong_type(e):
            raise
        client.delete(key)
        client.hset(key, mapping=dict(fields))


def expired(client: redis.Redis | RedisCluster, key: Callable[[int, str], str], watermarks: Mapping[int, int],
            limit: int, unreadable: Unreadable | None) -> dict[int, tuple[list[str], int]]:
    """RedisStore.expired. A query id not UTF-8 is no id of ours (ids are text: the pipeline
    could never close it, and the sweep would read it again at every turn): removed from
    the open set and the records, counted (kind `query`); an open set of another type is
    no open query (the next checkpoint replaces it)."""
    partitions = list(watermarks)
    with client.pipeline(transaction=False) as pipe:
        for p in partitions:
            pipe.zrangebyscore(key(p, "open"), "-inf", watermarks[p], start=0, num=limit)
            pipe.zcard(key(p, "open"))
        results = replies(pipe, None)
    out, bad = {}, {}
    for i, p in enumerate(partitions):
        ids = []
        for q in results[2 * i] or []:
            try:
                ids.append(q.decode())
            except UnicodeDecodeError:
                bad.setdefault(p, []).append(q)
        out[p] = (ids, (results[2 * i + 1] or 0) - len(bad.get(p, ())))
    if bad:
        with client.pipeline(transaction=False) as pipe:
            for p, ids in bad.items():
                pipe.zrem(key(p, "open"), *ids)
                pipe.hdel(key(p, "queries"), *ids)
            replies(pipe, None)
        for p, ids in bad.items():
            for q in ids:
                if unreadable is not None:
                    unreadable.skip("query", f"{{{p}}}:open", q[:100].decode(errors="backslashreplace"),
                                    "not UTF-8: removed with its record")
    return out


def eviction_policy(client: redis.Redis | RedisCluster) -> str | None:
    """Redis's maxmemory-policy, or None when CONFIG is not allowed (managed Redis, ACLs)."""
    try:
        found = client.config_get("maxmemory-policy")
    except redis.ResponseError:
        return None
    values = found.values() if isinstance(found, dict) else []
    policies = {v.decode() if isinstance(v, bytes) else str(v) for v in values}
    return policies.pop() if len(policies) == 1 else ",".join(sorted(policies))


def commit_args(c: PartitionCheckpoint) -> list:
    """redis_scripts.COMMIT's arguments for a checkpoint (its keys: RedisStore.commit)."""
    args: list = [c.epoch, c.layout, c.expect]
    sections = ([(q, r) for q, r in c.records.items()], [(d, q) for q, d in c.deadlines.items()],
                list(c.buckets.items()), list(c.offsets.items()),
                [(f"watermark:{t}", w) for t, w in c.watermarks.items()] + list(c.meta.items()),
                list(c.ab.items()))
    for pairs in sections:
        args.append(len(pairs))
        args += [x for pair in pairs for x in pair]
    for ids in (c.deleted, c.dropped_buckets, c.meta_deleted, *([hll.element(u) for u in users]
                                                                 for users in c.users.values())):
        args.append(len(ids))
        args += ids
    return args
