"""Dead letters that fit: a message over the producer's or the topic's size limit is cut
to fit, never dropped, with a header giving its value's original size (docs/delivery.md).
Pure functions: the Kafka producers (kafka/producer.py) and the in-process bus use them."""

from __future__ import annotations

TRUNCATED = "rankmeter.truncated"  # header: the value's size before it was cut, in bytes
# A record's and its batch's framing in bytes, generously: Kafka's is 61 per batch plus
# about 20 per record and header, so that a message cut to `limit - FRAMING` fits.
FRAMING = 512

Headers = list[tuple[str, bytes]]


def size(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    return len(key or b"") + len(value or b"") + sum(len(k.encode()) + len(v) for k, v in headers)


def fit(key: bytes | None, value: bytes | None, headers: Headers, limit: int
        ) -> tuple[bytes | None, bytes | None, Headers]:
    """The message unchanged when it fits in `limit` bytes, else its value cut to fit and a
    `rankmeter.truncated` header added. When the key and headers alone are too large, only
    rankmeter's own headers are kept and the key is cut as well."""
    if size(key, value, headers) + FRAMING <= limit:
        return key, value, headers
    marked = [*headers, (TRUNCATED, str(len(value or b"")).encode())]
    room = limit - FRAMING - size(key, None, marked)
    if room < 0:
        marked = [h for h in marked if h[0].startswith("rankmeter.")]
        if key is not None:
            key = key[:max(0, limit - FRAMING - size(None, None, marked)) // 2]
        room = max(0, limit - FRAMING - size(key, None, marked))
    return key, (value or b"")[:room], marked
