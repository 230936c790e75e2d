"""The confluent backend's source on the real broker, below `serve`: a partition handed to
another member by a rebalance is not read any further here, even from records librdkafka
had already fetched, and the new owner starts where the store says. Two members process
a stream while the second joins and leaves: every record is processed exactly once."""

from __future__ import annotations

import uuid

import pytest

from rankmeter import config
from serving import produce, unique_topics, wait_until

pytestmark = pytest.mark.integration
confluent = pytest.importorskip("rankmeter.kafka.confluent")


class Member:
    """A ConfluentSource with a pretend store: the next offset of each partition, written
    after every batch, as serve's checkpoint does; claims resume from it."""

    def __init__(self, settings: config.Kafka, topics: list[str], store: dict, processed: list) -> None:
        self.source = confluent.ConfluentSource(settings)
        self.topics, self.store, self.processed = topics, store, processed
        self.count = 0
        self.source.subscribe(topics, self.claim, lambda partitions: None)

    def claim(self, partitions: list[int]) -> dict[tuple[str, int], int]:
        return {(t, p): self.store.get((t, p), 0) for t in self.topics for p in partitions}

    def step(self) -> None:
        # Small batches: librdkafka has fetched far ahead of what is handed out, so a
        # rebalance finds records of every partition waiting in its queue.
        records = self.source.poll(100, 50)
        held = set(self.source.assigned())
        for r in records:
            assert r.partition in held, f"a record of partition {r.partition}, no longer held, handed out"
            self.processed.append((r.topic, r.partition, r.offset))
            self.store[(r.topic, r.partition)] = r.offset + 1
        self.count += len(records)


def test_a_rebalance_hands_each_record_to_exactly_one_member(kafka_bootstrap):
    topics = unique_topics(kafka_bootstrap, partitions=4)
    per_topic = 4000
    for topic in (topics.impressions, topics.feedback):
        produce(kafka_bootstrap, topic, [(f"q{i}", {"i": i}) for i in range(per_topic)])
    settings = config.load(None, {"RANKMETER_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
                                  "RANKMETER_KAFKA_GROUP_ID": f"g-{uuid.uuid4().hex[:6]}",
                                  "RANKMETER_KAFKA_BACKEND": "confluent"}).kafka
    store: dict = {}
    processed: list = []
    names = [topics.impressions, topics.feedback]
    a = Member(settings, names, store, processed)

    def a_reads() -> bool:
        a.step()
        return a.count > 0

    def shared() -> bool:
        # B polls with nothing to read yet: A's pace is a batch of 50 per B's 100 ms, so the
        # rebalance comes while A has most of the stream still before it.
        a.step()
        b.step()
        return len(a.source.assigned()) == 2 and len(b.source.assigned()) == 2 and b.count > 0

    def a_finishes() -> bool:
        a.step()
        return len(processed) >= 2 * per_topic and len(a.source.assigned()) == 4

    wait_until(a_reads, 60, "A to read", interval=0)
    b = Member(settings, names, store, processed)
    try:
        wait_until(shared, 60, "A and B to share the partitions and both read", interval=0)
        b.source.close()  # B leaves: A gets its partitions back, from B's stored offsets
        wait_until(a_finishes, 60, "A to finish the stream", interval=0)
    finally:
        a.source.close()
    assert a.count + b.count == len(processed) == len(set(processed)) == 2 * per_topic  # none twice, none lost
    offsets: dict = {}
    for topic, partition, offset in processed:
        offsets.setdefault((topic, partition), []).append(offset)
    assert len(offsets) == 8 and all(o == list(range(len(o))) for o in offsets.values())  # in order, no gap
    assert 0 < b.count < a.count
