"""Dead letters at least once (issue 19, item 5): cut to fit rather than dropped
(`dead_letters.fit`), kept until acknowledged and sent again when refused (`Outbox`), and
acknowledged before the batch's checkpoint is stored (`serve`). On the real broker:
tests/integration/test_dead_letter_delivery.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import msgspec

from rankmeter import config, serve
from rankmeter.dead_letters import FRAMING, TRUNCATED, fit, size
from rankmeter.kafka.producer import Outbox, Refused, TooLarge
from rankmeter.source import Bus, SourceUnavailable
from rankmeter.store import MemoryStore

REASON = [("rankmeter.reason", b"not JSON"), ("rankmeter.source.offset", b"7")]


def test_a_message_that_fits_is_unchanged():
    assert fit(b"q1", b"x" * 100, REASON, 1000) == (b"q1", b"x" * 100, REASON)


def test_a_message_over_the_limit_is_cut_to_fit_with_its_original_size():
    key, value, headers = fit(b"q1", b"x" * 5000, REASON, 2000)
    assert key == b"q1" and headers == [*REASON, (TRUNCATED, b"5000")]
    assert value == b"x" * len(value) and size(key, value, headers) == 2000 - FRAMING


def test_a_key_and_headers_too_large_keep_rankmeters_headers_and_a_cut_key():
    own = [("trace", b"t" * 5000), *REASON]
    key, value, headers = fit(b"k" * 5000, b"x" * 10, own, 2000)
    assert headers == [*REASON, (TRUNCATED, b"10")]
    assert 0 < len(key) < 5000 and size(key, value, headers) <= 2000 - FRAMING


class FakeProducer:
    """A producer whose deliveries the test settles: `acks` the pending ones, or refuses them."""

    def __init__(self, max_bytes: int = 10_000, refuse_over: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.refuse_over = refuse_over  # TooLarge at once above this many bytes
        self.sent: list[tuple[bytes | None, list]] = []  # value, headers of each send
        self.waiting: list = []

    def send(self, topic, key, value, headers=None, timestamp_ms=None, on_done=None):
        if self.refuse_over is not None and size(key, value, headers or []) > self.refuse_over:
            raise TooLarge("over max_request_size")
        self.sent.append((value, headers))
        self.waiting.append(on_done)

    def settle(self, refused: Refused | None = None) -> None:
        waiting, self.waiting = self.waiting, []
        for on_done in waiting:
            on_done(refused)

    def flush(self, timeout_s=None):
        pass

    def close(self, timeout_s=None):
        pass


def test_the_outbox_is_delivered_only_once_every_message_is_acknowledged():
    producer = FakeProducer()
    outbox = Outbox(producer)
    assert outbox.delivered(0)
    outbox.send("dlq", b"q1", b"{", REASON)
    outbox.send("dlq", b"q2", b"[", REASON)
    assert not outbox.delivered(0)
    producer.settle()
    assert outbox.delivered(0) and outbox.problem == ""


def test_a_refused_delivery_is_sent_again_and_not_delivered_until_acknowledged():
    producer = FakeProducer()
    outbox = Outbox(producer)
    outbox.send("dlq", b"q1", b"{", REASON)
    producer.settle(Refused("KafkaTimeoutError: expired", too_large=False))
    assert not outbox.delivered(0)                 # sent again, not yet acknowledged
    assert outbox.problem == "KafkaTimeoutError: expired"
    assert [v for v, _ in producer.sent] == [b"{", b"{"]
    producer.settle()
    assert outbox.delivered(0)


def test_a_delivery_refused_for_its_size_is_sent_again_cut_smaller_never_dropped():
    producer = FakeProducer(max_bytes=100_000)
    outbox = Outbox(producer)
    outbox.send("dlq", b"q1", b"x" * 60_000, REASON)
    # The topic takes at most 20,000 bytes (max.message.bytes below the producer's limit).
    while (sent := producer.sent[-1]) and size(b"q1", *sent) > 20_000:
        producer.settle(Refused("MessageSizeTooLargeError", too_large=True))
        outbox.delivered(0)
    value, headers = producer.sent[-1]
    assert (TRUNCATED, b"60000") in headers and 0 < len(value) < 20_000 and value == b"x" * len(value)
    producer.settle()
    assert outbox.delivered(0)


def test_a_message_the_producer_refuses_at_once_for_its_size_is_cut_and_sent():
    producer = FakeProducer(max_bytes=100_000, refuse_over=30_000)
    outbox = Outbox(producer)
    outbox.send("dlq", b"q1", b"x" * 200_000, REASON)  # cut to 100,000, refused, 50,000, refused, 25,000
    value, headers = producer.sent[-1]
    assert len(producer.sent) == 1 and (TRUNCATED, b"200000") in headers and 20_000 < len(value) < 25_000


def test_a_message_the_producer_cannot_take_now_is_not_kept():
    class Full(FakeProducer):
        def send(self, *args, **kwargs):
            raise SourceUnavailable("buffer full")

    outbox = Outbox(Full())
    try:
        outbox.send("dlq", b"q1", b"{", REASON)
    except SourceUnavailable:
        pass
    assert outbox.delivered(0)  # the caller sends it again (serve's dead_letter retries)


# ---- serve: the checkpoint waits for the dead letters ----

class UnacknowledgedBus(Bus):
    """A bus whose dead letters are acknowledged only once `ack` is set."""

    def __init__(self) -> None:
        super().__init__(partitions=1)
        self.ack = threading.Event()
        self.asked = 0

    def delivered(self, timeout_s: float) -> bool:
        self.asked += 1
        return self.ack.is_set()


def wait_until(condition, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_stores_no_checkpoint_past_a_dead_letter_before_it_is_acknowledged(monkeypatch):
    monkeypatch.setattr(serve, "RECOVERY_BACKOFF_S", (0.01, 0.02))
    settings = config.load(None, {"RANKMETER_METRICS_PORT": str(free_port()),
                                  "RANKMETER_METRICS_BIND_ADDRESS": "127.0.0.1"})
    topic = settings.kafka.impressions_topic
    bus, store, stop = UnacknowledgedBus(), MemoryStore(), threading.Event()
    now_ms = int(time.time() * 1000)
    bus.send(topic, b"q1", b"{not json")
    bus.send(topic, b"q2", json.dumps({"query_id": "q2", "ranker": "a", "timestamp": now_ms,
                                       "results": ["x"]}).encode())
    runner = threading.Thread(target=serve.run, args=(msgspec.structs.replace(settings), bus, store, stop))
    runner.start()
    try:
        wait_until(lambda: bus.asked >= 3)          # the batch waits for its dead letter ...
        dead = bus.logs[settings.kafka.dead_letter_topic][0]
        assert len(dead) >= 1 and dead[0].value == b"{not json"
        assert store.offsets.get(0, {}).get(topic, 0) == 0   # ... and nothing of it is stored
        bus.ack.set()
        wait_until(lambda: store.offsets.get(0, {}).get(topic) == 2)
    finally:
        stop.set()
        runner.join(30)
    assert not runner.is_alive()


def test_the_in_process_bus_cuts_a_dead_letter_as_kafka_would_refuse_it():
    bus = Bus(partitions=1, max_message_bytes=2000)
    bus.produce("dlq", b"q1", b"x" * 5000, REASON)
    bus.produce("dlq", b"q2", b"small", REASON)
    cut, small = bus.logs["dlq"][0]
    assert dict(cut.headers)[TRUNCATED] == b"5000" and 0 < len(cut.value) < 2000
    assert small.value == b"small" and small.headers == REASON
