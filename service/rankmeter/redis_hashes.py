"""Reading Redis hashes whole or in part, one round trip per step, for many keys at once
(pipelined: the keys may be on several cluster nodes)."""

from __future__ import annotations

from collections.abc import Collection

import redis


def load(client: redis.Redis, keys: list[str], only: Collection[str] | None = None,
         without: Collection[str] = ()) -> list[dict[str, bytes]]:
    """Each hash's fields (their names decoded): those in `only` if given, never those in
    `without` (then the names are read first, so the values left out never travel)."""
    if only is None and not without:
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            return [{k.decode(errors="replace"): v for k, v in found.items()} for found in pipe.execute()]
    if only is None:
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hkeys(key)
            names = [[n for n in (k.decode(errors="replace") for k in found) if n not in without] for found in pipe.execute()]
    else:
        names = [[f for f in only if f not in without] for _ in keys]
    with client.pipeline(transaction=False) as pipe:
        for key, fields in zip(keys, names):
            if fields:
                pipe.hmget(key, fields)
        values = iter(pipe.execute())
    # (a field deleted between both reads comes back None: left out)
    return [{f: v for f, v in zip(fields, next(values) if fields else []) if v is not None} for fields in names]
