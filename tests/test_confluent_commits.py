"""kafka/confluent.py `OneCommitInFlight`: offsets reach the broker one commit at a time, the
latest of each partition given meanwhile sent with the next, once the previous is answered
(even with an error); flushed at a revocation or close without waiting; a commit never
answered is not waited for past librdkafka's request timeout."""

from __future__ import annotations

import time

from confluent_kafka import KafkaError

from rankmeter.kafka.confluent import COMMIT_ANSWER_S, OneCommitInFlight


class Consumer:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def commit(self, offsets, asynchronous: bool) -> None:
        assert asynchronous
        self.sent.append({(tp.topic, tp.partition): tp.offset for tp in offsets})


def test_one_commit_at_a_time_the_latest_offsets_next() -> None:
    consumer = Consumer()
    commits = OneCommitInFlight(consumer)
    commits.give({("t", 0): 5})
    commits.give({("t", 0): 9, ("t", 1): 3})
    commits.give({("t", 0): 12})
    assert consumer.sent == [{("t", 0): 5}]  # the others wait for its answer
    commits.answered(KafkaError(KafkaError._TIMED_OUT))  # (an error: the next carries them anyway)
    assert consumer.sent[1:] == [{("t", 0): 12, ("t", 1): 3}]
    commits.answered(None)
    assert len(consumer.sent) == 2  # nothing waited
    commits.give({("t", 1): 4})
    assert consumer.sent[2:] == [{("t", 1): 4}]


def test_flushed_without_waiting_and_a_lost_answer_not_waited_for() -> None:
    consumer = Consumer()
    commits = OneCommitInFlight(consumer)
    commits.give({("t", 0): 1})
    commits.give({("t", 0): 2})
    commits.flush()  # a revocation: the partitions' last offsets while they are still ours
    assert consumer.sent == [{("t", 0): 1}, {("t", 0): 2}]
    commits.give({("t", 0): 3})
    assert len(consumer.sent) == 2
    commits.sent_at = time.monotonic() - COMMIT_ANSWER_S - 1  # its answer never came
    commits.give({("t", 0): 4})
    assert consumer.sent[2:] == [{("t", 0): 4}]


def test_a_flush_while_one_is_out_keeps_counting_both() -> None:
    consumer = Consumer()
    commits = OneCommitInFlight(consumer)
    commits.give({("t", 0): 1})
    commits.give({("t", 0): 2})
    commits.flush()  # two out now
    commits.give({("t", 0): 3})
    commits.answered(None)
    assert len(consumer.sent) == 2  # one still out: 3 waits
    commits.answered(None)
    assert consumer.sent[2:] == [{("t", 0): 3}]


class FakeConsumer(Consumer):
    """What ConfluentSource builds instead of librdkafka's Consumer: its settings kept."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config

    def close(self) -> None:
        pass


def test_the_source_wires_the_answers_the_revocation_and_close(monkeypatch) -> None:
    from rankmeter import config
    from rankmeter.kafka import confluent

    monkeypatch.setattr(confluent, "Consumer", FakeConsumer)
    source = confluent.ConfluentSource(config.load(None, {}).kafka)
    consumer = source.consumer
    source.commit({("t", 0): 5})
    source.commit({("t", 0): 6})
    assert consumer.sent == [{("t", 0): 5}]
    consumer.config["on_commit"](None, [])  # librdkafka's answer reaches the commits
    assert consumer.sent[1:] == [{("t", 0): 6}]
    # A revocation: the pipeline's revoke settles its last checkpoint (a commit, while one is
    # out), then those offsets go at once, while the partitions are still ours.
    source._on_revoke = lambda partitions: source.commit({("t", 0): 7})
    source._revoked_cb(consumer, [confluent.TopicPartition("t", 0)])
    assert consumer.sent[2:] == [{("t", 0): 7}]
    source.commit({("t", 0): 8})  # (out: waits) ...
    source.close()  # ... and goes at close
    assert consumer.sent[3:] == [{("t", 0): 8}]
