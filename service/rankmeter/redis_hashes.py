"""Reading Redis hashes whole or in part, one round trip per step, for many keys at once
(pipelined: the keys may be on several cluster nodes). A key of another type holds no
fields: nothing a stored value holds may crash a look."""

from __future__ import annotations

from collections.abc import Collection

import redis


def wrong_type(e: Exception) -> bool:
    """A key of another type than the command's. Only that: a full Redis (OOM), a cluster
    slot failing over (CLUSTERDOWN) or another client's long script (BUSY) is an outage
    to wait out (`RedisStore.unavailable`), never "nothing stored" (review s11 H1, H2)."""
    return isinstance(e, redis.ResponseError) and str(e).startswith("WRONGTYPE")


def replies(pipe: redis.client.Pipeline, empty: object) -> list:
    """The pipeline's replies, `empty` for a key of another type; any other error raised."""
    found = pipe.execute(raise_on_error=False)
    for reply in found:
        if isinstance(reply, Exception) and not wrong_type(reply):
            raise reply
    return [empty if isinstance(reply, Exception) else reply for reply in found]


def load(client: redis.Redis, keys: list[str], only: Collection[str] | None = None,
         without: Collection[str] = ()) -> list[dict[str, bytes]]:
    """Each hash's fields (their names decoded): those in `only` if given, never those in
    `without` (then the names are read first, so the values left out never travel)."""
    if only is None and not without:
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            return [{k.decode(errors="replace"): v for k, v in found.items()} for found in replies(pipe, {})]
    if only is None:
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hkeys(key)
            names = [[n for n in (k.decode(errors="replace") for k in found) if n not in without] for found in replies(pipe, [])]
    else:
        names = [[f for f in only if f not in without] for _ in keys]
    with client.pipeline(transaction=False) as pipe:
        for key, fields in zip(keys, names):
            if fields:
                pipe.hmget(key, fields)
        values = iter(replies(pipe, []))
    # (a field deleted between both reads comes back None: left out)
    return [{f: v for f, v in zip(fields, next(values) if fields else []) if v is not None} for fields in names]
