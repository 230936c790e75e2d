"""A partition's stored state read at a claim (or, read-only, for `rankmeter report`): one
transaction, so a new epoch and the state it owns are one snapshot (redis_store.py).

A key of the partition's of another type than ours holds nothing readable: counted (kind
`key`, its name as the field) and read as empty, never raised (a claim raising would
refuse the partition for ever). The buckets, A/B sums, records and open set start afresh
(the next checkpoint, `redis_scripts.COMMIT`, replaces the key). The offsets or the meta
(its layout history, which the stored buckets and records are read by, and the last
checkpoint's mark) of another type leave no starting point: the partition is lost as for
an unreadable offset (`serve --rebuild` rebuilds it), and a meta of another type gets a
fresh epoch (`REPAIR_EPOCH`: a time in ms, above any count of claims, so every earlier
owner is fenced and two replicas repairing at once still get distinct epochs).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from redis.cluster import RedisCluster

from rankmeter.redis_hashes import wrong_type
from rankmeter.store import PartitionSnapshot, layout_history, numbers

READ = ("offsets", "meta", "buckets", "ab")   # HGETALL
TYPES = {"queries": "hash", "open": "zset"}    # only their type is read here
ANOTHER_TYPE = "a key of another type"


def _replies(client: redis.Redis | RedisCluster, key: Callable[[str], str], claim: bool) -> list:
    with client.pipeline(transaction=True) as pipe:
        if claim:
            pipe.hincrby(key("meta"), "epoch", 1)
        for name in READ:
            pipe.hgetall(key(name))
        for name in TYPES:
            pipe.type(key(name))
        return pipe.execute(raise_on_error=False)


def snapshot(client: redis.Redis | RedisCluster, key: Callable[[str], str], repair_epoch: Callable[..., object],
             claim: bool) -> PartitionSnapshot:
    """The partition's snapshot; with `claim`, under a new epoch. `key(name)` is the
    partition's key of that name; `repair_epoch` the registered REPAIR_EPOCH script."""
    found = _replies(client, key, claim)
    unreadable: list[tuple[str, str, str]] = []
    meta_lost = False
    if claim and isinstance(found[0], redis.ResponseError):
        # The stored epoch cannot be incremented (not an integer, an overflow, or the meta
        # of another type): a new one no owner can hold fences every earlier owner.
        error = str(found[0])
        if not ("not an integer" in error or "overflow" in error or wrong_type(found[0])):
            raise found[0]
        meta_lost = wrong_type(found[0])
        repair_epoch(keys=[key("meta")], args=[int(time.time() * 1000)])
        found = _replies(client, key, claim)
        if isinstance(found[0], Exception):
            raise found[0]
        if not meta_lost:
            unreadable.append(("epoch", "epoch", error[:100]))
    found = found[1:] if claim else found
    read = dict(zip(READ, found))
    for name, reply in read.items():
        if isinstance(reply, Exception):
            if not wrong_type(reply):
                raise reply
            read[name] = {}
            unreadable.append(("key", name, f"{ANOTHER_TYPE}: read as empty"))
    for name, reply in zip(TYPES, found[len(READ):]):
        if isinstance(reply, Exception):
            raise reply
        if (reply.decode() if isinstance(reply, bytes) else reply) not in ("none", TYPES[name]):
            unreadable.append(("key", name, f"{ANOTHER_TYPE}: replaced at the next checkpoint"))
    if meta_lost:  # (repaired: a hash by now)
        unreadable.append(("key", "meta", f"{ANOTHER_TYPE}: replaced, the epoch started afresh"))
    meta_lost = any(kind == "key" and name == "meta" for kind, name, _ in unreadable)
    meta = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in read["meta"].items()}
    # An offset that cannot be read: none is trusted (resuming one topic from 0 would
    # count its events twice); the partition has no stored state, and Kafka's commit
    # says it is lost (`serve --rebuild` rebuilds it).
    stored, bad_offsets = numbers({k.decode(errors="replace"): v.decode(errors="replace")
                                   for k, v in read["offsets"].items()})
    unreadable += [("offsets", topic, "not an integer: no offset of the partition used") for topic in bad_offsets]
    watermarks, bad = numbers({k[len("watermark:"):]: v for k, v in meta.items() if k.startswith("watermark:")})
    unreadable += [("watermark", topic, "not an integer") for topic in bad]
    lists, bad = numbers({k[len("list:"):]: v for k, v in meta.items() if k.startswith("list:")})
    unreadable += [("list", query, "not an integer") for query in bad]
    epoch = numbers({"epoch": meta.get("epoch", "0")})[0].get("epoch", 0)  # read-only load
    trusted = not (bad_offsets or meta_lost)
    return PartitionSnapshot(
        epoch, stored if trusted else {}, watermarks,
        meta.get("layout", ""), {k.decode(errors="replace"): v for k, v in read["buckets"].items()},
        {k.decode(errors="replace"): v for k, v in read["ab"].items()}, *layout_history(meta), meta.get("mark", ""),
        lists, tuple(unreadable))

