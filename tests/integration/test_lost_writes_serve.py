"""Issue 19, items 3 and 4, on the real Kafka and Redis with the real `rankmeter serve`:
Redis put back to an earlier copy of its data mid-stream (its last checkpoints lost), a
topic deleted and created again under a running serve, and records deleted below the
stored offset (the admin client's delete_records)."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid

import pytest
import redis
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import TopicAlreadyExistsError
from redis.cluster import RedisCluster

from serving import Serve, free_port, produce, unique_topics, wait_until
from test_faults import assert_exact, counter, delete_prefix, messages_of, produce_chunk, reference, split
from test_restart import FAST_FAILOVER, aggregates, caught_up

pytestmark = [pytest.mark.integration, pytest.mark.long]

RESUME = {"RANKMETER_KAFKA_ON_OFFSETS_RESET": "resume"}


def labelled(serve: Serve, name: str) -> dict[frozenset, float]:
    return {labels: v for (n, labels), v in serve.metrics().items() if n == name}


def end_offsets(bootstrap: str, topic: str, partitions: int = 4) -> dict[int, int]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        found = consumer.end_offsets([TopicPartition(topic, p) for p in range(partitions)])
        return {tp.partition: o for tp, o in found.items()}
    finally:
        consumer.close()


class Stored:
    """Whether Redis holds every partition of both topics to its end (the stored offsets;
    Kafka's own commit, for lag tooling, may be a batch behind)."""

    def __init__(self, bootstrap: str, client: redis.Redis, prefix: str, topics) -> None:
        self.consumer, self.client, self.prefix = KafkaConsumer(bootstrap_servers=bootstrap), client, prefix
        self.partitions = [TopicPartition(t, p) for t in (topics.impressions, topics.feedback) for p in range(4)]

    def __call__(self) -> bool:
        end = self.consumer.end_offsets(self.partitions)
        stored = {p: self.client.hgetall(f"{self.prefix}:{{{self.prefix}:{p}}}:offsets") for p in range(4)}
        return all(int(stored[tp.partition].get(tp.topic.encode(), 0)) == end[tp] for tp in self.partitions)

    def close(self) -> None:
        self.consumer.close()


def impressions(prefix: str, n: int) -> list[tuple[str, dict]]:
    now = int(time.time() * 1000)
    return [(f"{prefix}{i}", {"query_id": f"{prefix}{i}", "ranker": "a", "timestamp": now - 1000,
                              "results": ["d1", "d2"]}) for i in range(n)]


def after_restart(serve: Serve, bootstrap: str, topics, chunk, settled, **env: str) -> dict:
    """serve stopped, `chunk` produced (feedback for queries open across the loss), serve
    started again (with `env`): its aggregates once `settled` and caught up."""
    assert serve.stop() == 0
    produce_chunk(bootstrap, topics, chunk)
    serve.env.update(env)
    serve.start()
    wait_until(lambda: settled() and caught_up(serve), 60, "serve to catch up after its restart")
    return aggregates(serve)


def test_redis_put_back_to_an_earlier_copy_mid_stream_recovers_exactly(kafka_bootstrap, redis_url, tmp_path):
    topics = unique_topics(kafka_bootstrap)
    first, second, third = split(messages_of(topics, seed=53, queries=1200), 0.4, 0.75)
    prefix, group = f"rm-{uuid.uuid4().hex[:6]}", f"g-{uuid.uuid4().hex[:6]}"
    log_path = tmp_path / "serve.log"
    serve = Serve(kafka_bootstrap, redis_url, topics, group, prefix,
                  {**FAST_FAILOVER, "RANKMETER_KAFKA_MAX_POLL_RECORDS": "100"}, log_path=log_path)
    client = redis.Redis.from_url(redis_url)
    committed = Stored(kafka_bootstrap, client, prefix, topics)
    try:
        serve.start()
        produce_chunk(kafka_bootstrap, topics, first)
        wait_until(committed, 60, "the first chunk stored")
        # The copy Redis is put back to (a backup, or what an async replica had).
        copy = {key: (client.dump(key), client.pttl(key)) for key in client.scan_iter(match=f"{prefix}:*")}
        assert len(copy) >= 4 * 4
        produce_chunk(kafka_bootstrap, topics, second)
        wait_until(committed, 60, "the second chunk stored (and committed to Kafka)")
        delete_prefix(client, prefix)
        for key, (data, ttl) in copy.items():
            client.restore(key, max(ttl, 0), data, replace=True)
        wait_until(lambda: counter(serve, "rankmeter_checkpoints_lost_total") >= 1, 30, "the loss to be found")
        wait_until(committed, 60, "the lost part to be read again")
        found = [line for line in log_path.read_text().splitlines() if "lost this partition's last checkpoints" in line]
        assert found and '"stored_offsets"' in found[0] and '"committed_offsets"' in found[0], found[:1]
        assert serve.get("/readyz")[0] == 200
        got = after_restart(serve, kafka_bootstrap, topics, third, committed)
    finally:
        serve.stop()
        client.close()
        committed.close()
    expected, _ = reference(kafka_bootstrap, redis_url, topics, tmp_path)
    assert_exact(got, expected)


def recreate(bootstrap: str, topic: str, partitions: int = 4) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.delete_topics([topic])
        wait_until(lambda: topic not in admin.list_topics(), 30, "the topic to be deleted")

        def created() -> bool:
            try:
                admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
                return True
            except TopicAlreadyExistsError:  # the deletion still under way
                return False
        wait_until(created, 30, "the topic to be created again")
    finally:
        admin.close()


def test_a_topic_recreated_under_a_running_serve_is_refused_then_resumed(kafka_bootstrap, redis_url, tmp_path):
    topics = unique_topics(kafka_bootstrap)
    serve = Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
                  FAST_FAILOVER, log_path=tmp_path / "serve.log")
    old, new = impressions("q", 200), impressions("n", 20)
    try:
        serve.start()
        produce(kafka_bootstrap, topics.impressions, old)
        wait_until(lambda: serve.events().get(("impressions", "applied"), 0) == len(old), 60, "the old log")
        recreate(kafka_bootstrap, topics.impressions)
        produce(kafka_bootstrap, topics.impressions, new)   # fewer records than were read

        def refused() -> bool:
            status, body = serve.get("/readyz")
            return status == 503 and "offsets reset" in body and "recreated" in body
        wait_until(refused, 60, "/readyz to name the recreated partitions")
        reset = labelled(serve, "rankmeter_offsets_reset_total")
        assert reset and {dict(k)["cause"] for k in reset} == {"recreated"}
        assert {dict(k)["topic"] for k in reset} == {topics.impressions}
        assert serve.events().get(("impressions", "applied"), 0) == len(old)  # nothing of the new log
        assert serve.stop() == 0

        serve.env.update(RESUME)
        serve.start()
        wait_until(lambda: serve.events().get(("impressions", "applied"), 0) == len(new), 60, "the new log")
        assert serve.get("/readyz")[0] == 200
        assert {dict(k)["cause"] for k in labelled(serve, "rankmeter_offsets_reset_total")} == {"recreated"}
        assert "rankmeter_offsets_skipped_total" in serve.metrics_text()
    finally:
        serve.stop()


def test_records_deleted_below_the_stored_offset_are_refused_then_the_gap_reported(
        kafka_bootstrap, redis_url, kafka_backend, tmp_path):
    topics = unique_topics(kafka_bootstrap)
    serve = Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
                  {**FAST_FAILOVER, **kafka_backend}, log_path=tmp_path / "serve.log")
    first, unread, last = impressions("a", 100), impressions("b", 100), impressions("c", 40)
    try:
        serve.start()
        produce(kafka_bootstrap, topics.impressions, first)
        wait_until(lambda: serve.events().get(("impressions", "applied"), 0) == len(first), 60, "the first records")
        assert serve.stop() == 0
        stored = end_offsets(kafka_bootstrap, topics.impressions)
        produce(kafka_bootstrap, topics.impressions, unread)
        # Retention passing the stored offset during an outage: records deleted before they were read.
        deleted = end_offsets(kafka_bootstrap, topics.impressions)
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            admin.delete_records({TopicPartition(topics.impressions, p): o for p, o in deleted.items() if o})
        finally:
            admin.close()
        produce(kafka_bootstrap, topics.impressions, last)

        serve.start(wait_ready=False)

        def refused() -> bool:
            status, body = serve.get("/readyz")
            return status == 503 and "offsets reset" in body and "truncated" in body
        wait_until(refused, 60, "/readyz to name the truncated partitions")
        gapped = {p for p in deleted if deleted[p] > stored[p]}
        reset = labelled(serve, "rankmeter_offsets_reset_total")
        assert {int(dict(k)["partition"]) for k in reset} == gapped
        assert {dict(k)["cause"] for k in reset} == {"truncated"}
        assert serve.events().get(("impressions", "applied"), 0) == 0
        assert serve.stop() == 0

        serve.env.update(RESUME)
        serve.start()
        wait_until(lambda: serve.events().get(("impressions", "applied"), 0) == len(last), 60, "the records after")
        skipped = {int(dict(k)["partition"]): v for k, v in labelled(serve, "rankmeter_offsets_skipped_total").items()
                   if dict(k)["topic"] == topics.impressions}
        assert skipped == {p: deleted[p] - stored[p] for p in gapped}
        assert sum(skipped.values()) == len(unread)
    finally:
        serve.stop()


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it) is a valid port too."""
    while (port := free_port()) > 55535:
        pass
    return port


class PrivateCluster:
    """A Redis Cluster of three masters, each with one replica, of this test's own (never
    the harness's), on free ports."""

    def __init__(self, directory) -> None:
        self.ports = [cluster_port() for _ in range(6)]
        self.directory = directory
        self.processes: dict[int, subprocess.Popen] = {}

    def start(self) -> PrivateCluster:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> PrivateCluster:
        for port in self.ports:
            node = self.directory / str(port)
            node.mkdir(parents=True)
            log = open(node / "redis.log", "ab")
            self.processes[port] = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node), "--save", "",
                 "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", "2000"], stdout=log, stderr=log)
        wait_until(lambda: all(self._answers(p) for p in self.ports), 30, "the cluster's nodes to answer")
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        wait_until(lambda: all(self.node(p).cluster("info")["cluster_state"] == "ok" for p in self.ports), 30,
                   "the cluster to be ok")
        wait_until(lambda: all(self.node(r).info("replication")["master_link_status"] == "up"
                               for r in self.replicas()), 30, "the replicas to be in sync")
        return self

    @staticmethod
    def _answers(port: int) -> bool:
        try:
            return redis.Redis(port=port, socket_timeout=1).ping()
        except redis.RedisError:
            return False

    @staticmethod
    def node(port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5, decode_responses=True)

    def replicas(self) -> list[int]:
        return [p for p in self.ports if self.node(p).info("replication")["role"] == "slave"]

    def replica_of(self, master: int) -> int:
        return next(r for r in self.replicas() if self.node(r).info("replication")["master_port"] == master)

    def stop(self) -> None:
        for process in self.processes.values():
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait(timeout=30)


def test_a_failover_to_a_replica_behind_is_found_and_recovered_exactly(kafka_bootstrap, redis_url, tmp_path):
    cluster = PrivateCluster(tmp_path / "cluster").start()
    topics = unique_topics(kafka_bootstrap)
    first, second, third = split(messages_of(topics, seed=59, queries=600), 0.4, 0.7)
    prefix = f"rm-{uuid.uuid4().hex[:6]}"
    url = f"redis://127.0.0.1:{cluster.ports[0]}/0"
    serve = Serve(kafka_bootstrap, url, topics, f"g-{uuid.uuid4().hex[:6]}", prefix,
                  {**FAST_FAILOVER, "RANKMETER_KAFKA_MAX_POLL_RECORDS": "100", "RANKMETER_REDIS_CLUSTER": "true"},
                  log_path=tmp_path / "serve.log")
    client = RedisCluster(host="127.0.0.1", port=cluster.ports[1])
    stored = Stored(kafka_bootstrap, client, prefix, topics)
    try:
        serve.start()
        produce_chunk(kafka_bootstrap, topics, first)
        wait_until(stored, 60, "the first chunk stored")
        # The replica of partition 0's master stops (replication stalls) while writes go on.
        master = client.get_node_from_key(f"{prefix}:{{{prefix}:0}}:meta").port
        replica = cluster.replica_of(master)
        cluster.processes[replica].send_signal(signal.SIGSTOP)
        # More than the sockets between them buffer (else the replica, resumed, would still
        # read what was sent before the master died): the writes after it stay in the master.
        cluster.node(master).set(f"padding:{{{prefix}:0}}", b"x" * (32 << 20))
        produce_chunk(kafka_bootstrap, topics, second)
        wait_until(stored, 60, "the second chunk stored on the master")
        cluster.processes[master].kill()
        cluster.processes[replica].send_signal(signal.SIGCONT)
        cluster.node(replica).execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        wait_until(lambda: counter(serve, "rankmeter_checkpoints_lost_total") >= 1, 60, "the lost tail to be found")
        wait_until(stored, 60, "the lost tail read again")
        # What Redis holds is whole: a restarted serve (memory gone) exports the exact sums;
        # through a node still up, in a group of its own (the old member's session need not
        # expire first: offsets resume from Redis either way).
        got = after_restart(serve, kafka_bootstrap, topics, third, stored,
                            RANKMETER_REDIS_URL=f"redis://127.0.0.1:{replica}/0",
                            RANKMETER_KAFKA_GROUP_ID=f"g-{uuid.uuid4().hex[:6]}")
    finally:
        serve.stop()
        stored.close()
        client.close()
        cluster.stop()
    expected, _ = reference(kafka_bootstrap, redis_url, topics, tmp_path)
    assert_exact(got, expected)
