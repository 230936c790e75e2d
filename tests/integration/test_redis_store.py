"""The Redis store's scripts on a real Redis: the checkpoint (chunked arguments, every
section, fencing, lost state) and the label cap with idle expiry."""

from __future__ import annotations

import uuid

import pytest
import redis

from rankmeter.redis_store import RedisStore
from rankmeter.store import FENCED, LOST, REWOUND, MemoryStore, PartitionCheckpoint

pytestmark = pytest.mark.integration


@pytest.fixture
def store(redis_url):
    s = RedisStore(redis_url, f"rs-{uuid.uuid4().hex[:8]}")
    yield s
    for key in s.client.scan_iter(match=f"{s.prefix}:*"):
        s.client.delete(key)
    s.close()


def checkpoint(epoch: int, **changes) -> PartitionCheckpoint:
    base = dict(partition=0, epoch=epoch, layout="L", offsets={}, watermarks={}, records={}, deadlines={},
                deleted=[], buckets={}, dropped_buckets=[], ab={}, meta={})
    return PartitionCheckpoint(**{**base, **changes})


def test_a_checkpoint_writes_every_section_in_chunks(store):
    epoch = store.claim(0).epoch
    records = {f"q{i}": b"r%d" % i for i in range(7001)}      # past the 4,000-argument chunks
    refused = store.commit([checkpoint(
        epoch, records=records, deadlines={q: i for i, q in enumerate(records)},
        buckets={"a\x1f\x1f1": b"x", "b\x1f\x1f2": b"y"}, offsets={"imp": 10, "fb": 7},
        watermarks={"imp": 123}, ab={"e\x1fa\x1f": b"z"}, meta={"history": "L"})])
    assert refused == {}
    assert store.client.hlen(store._key(0, "queries")) == 7001 and store.client.zcard(store._key(0, "open")) == 7001
    assert store.client.zscore(store._key(0, "open"), "q7000") == 7000
    deleted = [f"q{i}" for i in range(4500)]
    assert store.commit([checkpoint(epoch, deleted=deleted, dropped_buckets=["a\x1f\x1f1"])]) == {}
    assert store.client.hlen(store._key(0, "queries")) == 2501 and store.client.zcard(store._key(0, "open")) == 2501
    snapshot = store.load(0)
    assert snapshot.offsets == {"imp": 10, "fb": 7} and snapshot.watermarks == {"imp": 123}
    assert snapshot.buckets == {"b\x1f\x1f2": b"y"} and snapshot.ab == {"e\x1fa\x1f": b"z"}
    assert snapshot.layout == "L" and snapshot.history == ["L"] and snapshot.epoch == epoch


def test_lists_and_the_mark_are_metadata_set_and_deleted_with_the_checkpoint_as_in_memory(store, redis_url):
    from rankmeter.store import MemoryStore

    memory = MemoryStore()
    for s in (store, memory):
        epoch = s.claim(0).epoch
        s.commit([checkpoint(epoch, meta={"list:q1": "100", "list:q2": "200", "mark": f"{epoch}:1"})])
        # Set and deleted in one checkpoint: the delete wins (it comes after).
        # (Each checkpoint expects the mark of the one before: the store lost nothing.)
        s.commit([checkpoint(epoch, meta={"list:q3": "300", "mark": f"{epoch}:2"}, meta_deleted=["list:q1", "list:q3"],
                             expect=f"{epoch}:1")])
    assert store.load(0).lists == memory.load(0).lists == {"q2": 200}
    assert store.load(0).mark == "1:2" and memory.load(0).mark == "1:2"
    assert store.commit([checkpoint(1, watermarks={"imp": 5}, expect="1:2")]) == {}
    store.wipe(0)   # a rebuild: every metadata field but the epoch goes
    snapshot = store.load(0)
    assert (snapshot.lists, snapshot.mark, snapshot.watermarks, snapshot.history, snapshot.epoch) == ({}, "", {}, [], 1)


def test_a_checkpoint_is_refused_unless_redis_holds_the_owners_last_mark(store, redis_url):
    """Redis put back to an earlier copy (a restore, a failover to a replica behind): the
    script refuses a checkpoint whose expected mark is not the stored one, nothing written;
    the epoch is checked first."""
    epoch = store.claim(0).epoch
    assert store.commit([checkpoint(epoch, offsets={"imp": 1}, meta={"mark": f"{epoch}:1"})]) == {}
    meta, offsets = store._key(0, "meta"), store._key(0, "offsets")
    copy = {key: store.client.dump(key) for key in (meta, offsets)}
    assert store.commit([checkpoint(epoch, offsets={"imp": 2}, meta={"mark": f"{epoch}:2"},
                                    expect=f"{epoch}:1")]) == {}
    for key, data in copy.items():
        store.client.restore(key, 0, data, replace=True)
    assert store.marks([0]) == {0: f"{epoch}:1"}
    assert store.commit([checkpoint(epoch, offsets={"imp": 3}, meta={"mark": f"{epoch}:3"},
                                    expect=f"{epoch}:2")]) == {0: REWOUND}
    assert store.load(0).offsets == {"imp": 1} and store.load(0).mark == f"{epoch}:1"
    assert store.commit([checkpoint(epoch - 1, expect=f"{epoch}:1")]) == {0: FENCED}


def test_a_stale_epoch_is_fenced_and_a_vanished_state_is_lost(store):
    old = store.claim(0).epoch
    new = store.claim(0).epoch
    assert new == old + 1
    assert store.commit([checkpoint(old, offsets={"imp": 5})]) == {0: FENCED}
    assert store.load(0).offsets == {}
    store.client.delete(store._key(0, "meta"))   # Redis restarted empty
    assert store.commit([checkpoint(new, offsets={"imp": 5})]) == {0: LOST}
    assert store.load(0).offsets == {}


def test_the_label_cap_admits_until_full_and_frees_idle_values(store):
    day = 86_400_000
    assert store.admit_label("ranker", "v1", 2, now_ms=0, idle_ms=2 * day)
    assert store.admit_label("ranker", "v2", 2, now_ms=day, idle_ms=2 * day)
    assert not store.admit_label("ranker", "v3", 2, now_ms=day, idle_ms=2 * day)
    assert store.admit_label("ranker", "v1", 2, now_ms=day, idle_ms=2 * day)    # known: refreshed
    assert not store.admit_label("ranker", "v3", 2, now_ms=2 * day, idle_ms=2 * day)
    assert store.admit_label("ranker", "v3", 2, now_ms=3 * day + 1, idle_ms=2 * day)  # v1, v2 idle > 2 days


def test_a_stale_claim_can_neither_wipe_nor_write_the_running_statistics(store):
    stale = store.claim(0).epoch
    owner = store.claim(0).epoch
    store.commit([checkpoint(owner, offsets={"imp": 5}, buckets={"b": b"1"})])
    assert store.wipe(0, stale) is False
    assert store.load(0).offsets == {"imp": 5} and store.load(0).buckets == {"b": b"1"}
    # Partition 0's holder keeps the experiment's running statistics and history.
    assert store.save_running("exp", {"P@10": "0.04"}, owner) is True
    assert store.save_running("exp", {"P@10": "0.30"}, stale) is False   # would move the minimum p back up
    assert store.append_look("exp", "stale", 10, stale) is False
    assert store.load_running("exp") == {"P@10": "0.04"} and store.looks("exp") == []
    assert store.append_look("exp", "a", 2, owner) and store.append_look("exp", "b", 2, owner)
    assert store.append_look("exp", "c", 2, owner) and store.looks("exp") == ["b", "c"]
    assert store.wipe(0, owner) is True
    snapshot = store.load(0)
    assert (snapshot.offsets, snapshot.buckets, snapshot.epoch) == ({}, {}, owner)


def test_stored_numbers_that_are_not_integers_do_not_stop_a_claim(store, redis_url):
    """Issue 19: nothing a stored value holds may crash a claim. Written by hand or by a bad
    restore: an epoch, an offset, a watermark, a list's time, a name, none an integer or UTF-8."""
    old = store.claim(0).epoch
    assert store.commit([checkpoint(old, offsets={"imp": 5, "fb": 7}, watermarks={"imp": 9},
                                    meta={"list:q1": "123"})]) == {}
    meta, offsets = store._key(0, "meta"), store._key(0, "offsets")
    store.client.hset(meta, mapping={"epoch": "twelve", "watermark:fb": "soon", "list:q2": "\xff", b"\xfflabel": b"\xfe"})
    claimed = store.claim(0)
    # A new epoch no earlier owner holds: the old owner's commit is fenced.
    assert claimed.epoch > 1_000_000_000_000 and store.commit([checkpoint(old, offsets={"imp": 6})]) == {0: FENCED}
    assert claimed.offsets == {"imp": 5, "fb": 7} and claimed.watermarks == {"imp": 9}
    assert claimed.lists == {"q1": 123}
    assert {(kind, field) for kind, field, _ in claimed.unreadable} == {
        ("epoch", "epoch"), ("watermark", "fb"), ("list", "q2")}
    # An offset that is not an integer: none of the partition's is trusted.
    store.client.hset(offsets, "fb", "7.5")
    again = store.claim(0)
    assert again.epoch == claimed.epoch + 1 and again.offsets == {}
    assert ("offsets", "fb") in {(kind, field) for kind, field, _ in again.unreadable}
    assert store.load(0).offsets == {}
    # An epoch HINCRBY would overflow is replaced too; two replicas repairing at once get
    # distinct epochs (the second repair finds the first's integer and leaves it).
    store.client.hset(meta, "epoch", str(2 ** 63 - 1))
    other = RedisStore(redis_url, store.prefix)   # another replica
    assert store._repair_epoch(keys=[meta], args=[1_900_000_000_000]) == 1
    assert other._repair_epoch(keys=[meta], args=[1_800_000_000_000]) == 0
    first, second = store.claim(0).epoch, other.claim(0).epoch
    assert first == 1_900_000_000_001 and second == first + 1
    store.client.hset(meta, "epoch", str(2 ** 63 - 1))
    assert store.claim(0).epoch > 1_000_000_000_000


def test_the_first_definition_of_an_experiment_wins_and_one_of_another_type_is_replaced(store):
    assert store.define_experiment("e", '["a#1"]') == '["a#1"]'
    assert store.define_experiment("e", '["a#1", "b"]') == '["a#1"]'   # another replica, another release
    key = f"{store.prefix}:ab:definition:g"
    store.client.hset(key, "x", "y")                                    # not a string: nothing readable
    assert store.define_experiment("g", '["a#1"]') == ""
    assert store.define_experiment("g", '["a#1"]', replace=True) == '["a#1"]'
    assert store.define_experiment("g", '["c"]') == '["a#1"]'


def test_a_definition_is_read_and_its_digest_computed_where_it_is_stored(store):
    """Review 4, M1: the CUPED means (6.3 MB) are compared at each claim by a digest."""
    import hashlib
    assert store.definition("d") == "" and store.definition_digest("d") is None
    text = "é" + "x" * 100_000
    store.define_experiment("d", text)
    assert store.definition("d") == text
    assert store.definition_digest("d") == hashlib.sha1(text.encode()).hexdigest()
    store.client.hset(f"{store.prefix}:ab:definition:h", "x", "y")      # not a string
    assert store.definition("h") == "" and store.definition_digest("h") == ""
    memory = MemoryStore()
    memory.define_experiment("d", text)
    assert memory.definition_digest("d") == store.definition_digest("d") and memory.definition("d") == text


def test_the_ab_sums_read_whole_only_some_or_without_some_as_in_memory(store):
    """A look reads the A/B sums without the CUPED table (`without`), the covariate only
    the table (`only`): the same fields as the memory store, the others never sent."""
    from rankmeter.store import MemoryStore

    memory = MemoryStore()
    fields = {"e\x1fa\x1f": b"z" * 8, "cuped\x1f\x1fpre": b"t" * 16, "propensity\x1f\x1fpairs": b"p" * 8}
    for s in (store, memory):
        s.commit([checkpoint(s.claim(0).epoch, ab=fields)])
    for kwargs in ({}, {"only": ("cuped\x1f\x1fpre",)}, {"without": ("cuped\x1f\x1fpre", "propensity\x1f\x1fpairs")},
                   {"only": ("missing", "e\x1fa\x1f")}, {"only": ()}):
        assert store.load_ab([0, 1], **kwargs) == memory.load_ab([0, 1], **kwargs), kwargs
    assert store.load_ab([0], without=("cuped\x1f\x1fpre",)) == {0: {"e\x1fa\x1f": b"z" * 8,
                                                                      "propensity\x1f\x1fpairs": b"p" * 8}}


def test_running_statistics_not_utf8_are_read_as_unreadable_text_not_a_crash(store):
    """Review (final): load_running decoded strictly, so one byte that is not UTF-8 in any
    running hash (a final decision's included) stopped every look, and serve."""
    from rankmeter.pipeline import final
    key = f"{store.prefix}:ab:running:base@1|final"
    store.client.hset(key, mapping={b"new\x1f": b"do_not_ship \xff1", b"\xfe\x1f": b"no_ship 1"})
    got = store.load_running("base@1|final")
    assert len(got) == 2 and final.parsed(got["new\x1f"]) is None


def test_an_ab_field_name_not_utf8_is_no_crash(store):
    """Review (CUPED) F6: a field name of a partition's A/B hash that is not UTF-8 stopped
    every look (load_ab decoded strictly)."""
    store.client.hset(store._key(0, "ab"), mapping={b"\xff\x1fa\x1f": b"x" * 8, "e\x1fa\x1f": b"y" * 8})
    for kwargs in ({}, {"without": ("z",)}):
        got = store.load_ab([0], **kwargs)[0]
        assert got["e\x1fa\x1f"] == b"y" * 8 and len(got) <= 2


@pytest.mark.parametrize("epoch", [True, False], ids=["fenced script", "plain write"])
def test_a_running_key_of_another_type_is_no_fields_then_replaced_not_a_crash(store, epoch):
    """A running hash's key holding a string (an operator's SET, another tool's prefix):
    HGETALL and HSET answered WRONGTYPE, and every look of the experiment, and serve, stopped."""
    owner = store.claim(0).epoch if epoch else None
    key = f"{store.prefix}:ab:running:exp"
    store.client.set(key, "not a hash")
    assert store.load_running("exp") == {}
    assert store.save_running("exp", {"P@10": "0.04"}, owner) is True
    assert store.load_running("exp") == {"P@10": "0.04"}


@pytest.mark.parametrize("epoch", [True, False], ids=["fenced script", "plain write"])
def test_running_statistics_of_many_fields_are_saved_whole(store, epoch):
    """SAVE passed every field to one HSET through Lua's unpack(), bounded by its C stack
    (~8,000 values): a record of an experiment with many arms and measures failed."""
    owner = store.claim(0).epoch if epoch else None
    fields = {f"m{i}\x1farm": str(i) for i in range(6000)}
    assert store.save_running("exp", fields, owner) is True
    assert store.load_running("exp") == fields


@pytest.mark.parametrize("error", [redis.exceptions.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'."),
                                   redis.exceptions.ClusterDownError("The cluster is down"),
                                   redis.ResponseError("BUSY Redis is busy running a script.")],
                         ids=["full", "cluster down", "busy"])
def test_an_outage_on_a_running_key_is_raised_not_read_as_no_fields_nor_replaced(store, monkeypatch, error):
    """Review s11 H1, H2: every ResponseError was taken for WRONGTYPE. A full Redis refusing the
    plain path's HSET had the hash deleted (DEL is allowed at maxmemory: every running statistic
    gone, saved True); a slot failing over read as no fields (every marked record "lost")."""
    key = f"{store.prefix}:ab:running:exp"
    store.client.hset(key, "P@10\x1fb", "1 2 3")

    def refused(*args, **kwargs):
        raise error
    monkeypatch.setattr(store.client, "hgetall", refused)
    monkeypatch.setattr(store.client, "hset", refused)
    with pytest.raises(redis.ResponseError):
        store.load_running("exp")
    with pytest.raises(redis.ResponseError):
        store.save_running("exp", {"P@10\x1fb": "4 5 6"})
    monkeypatch.undo()
    assert store.load_running("exp") == {"P@10\x1fb": "1 2 3"}


@pytest.mark.parametrize("epoch", [True, False], ids=["fenced script", "plain write"])
def test_a_looks_key_of_another_type_is_no_looks_then_replaced_not_a_crash(store, epoch):
    """Review s11: the looks list's key holding a string failed APPEND's RPUSH: raised out of
    the experiment look at every history interval (serve's crash loop)."""
    owner = store.claim(0).epoch if epoch else None
    store.client.set(f"{store.prefix}:ab:looks:exp", "not a list")
    assert store.looks("exp") == []
    assert store.append_look("exp", '{"t": 1}', 10, owner) is True
    assert store.looks("exp") == ['{"t": 1}']


def test_a_stored_look_not_utf8_is_read_with_replacement_characters(store):
    """Review s11: `looks()` decoded strictly: one hostile line and `rankmeter report ab` died."""
    store.client.rpush(f"{store.prefix}:ab:looks:exp", b"\xff\xfe", b'{"t": 2}')
    assert store.looks("exp") == ["\ufffd\ufffd", '{"t": 2}']


def test_an_open_query_id_not_utf8_is_removed_with_its_record_and_counted(store):
    """Review s11: `expired()` decoded the open set strictly (serve's sweep died). Such an id is
    none of ours (ids are text): removed from the open set and the records, counted once,
    not read again at every sweep; an open set of another type is no open query."""
    from rankmeter.unreadable import Unreadable

    unreadable = Unreadable()
    store.client.zadd(store._key(0, "open"), {b"\xff": 1, "q1": 2, "q2": 500})
    store.client.hset(store._key(0, "queries"), mapping={b"\xff": b"r", "q1": b"r1"})
    assert store.expired({0: 10}, 100, unreadable) == {0: (["q1"], 2)}
    assert unreadable.counts["query"] == 1
    assert store.client.zcard(store._key(0, "open")) == 2 and store.client.hkeys(store._key(0, "queries")) == [b"q1"]
    assert store.expired({0: 10}, 100, unreadable) == {0: (["q1"], 2)} and unreadable.counts["query"] == 1
    store.client.set(store._key(1, "open"), "not a zset")
    assert store.expired({1: 10}, 100, unreadable) == {1: ([], 0)}


@pytest.mark.parametrize("name", ["buckets", "ab", "queries", "open"])
def test_a_partition_key_of_another_type_is_counted_read_empty_and_replaced_at_the_commit(store, name):
    """Review s11: a key of the partition's of another type made every claim raise (the
    replica never ready). It holds nothing readable: counted, read as empty, and replaced by
    the next checkpoint, within the fenced script and before it writes anything (a script
    failing midway is not rolled back)."""
    old = store.claim(0).epoch
    full = dict(offsets={"imp": 5}, records={"q1": b"r"}, deadlines={"q1": 9}, buckets={"a\x1f\x1f1": b"x"},
                ab={"e\x1fa\x1f": b"y" * 8})
    assert store.commit([checkpoint(old, **full)]) == {}
    key = store._key(0, name)
    store.client.delete(key)
    store.client.set(key, "not this type")
    claimed = store.claim(0)
    assert ("key", name) in {(kind, field) for kind, field, _ in claimed.unreadable}
    assert claimed.offsets == {"imp": 5}
    assert (claimed.buckets == {}) == (name == "buckets") and (claimed.ab == {}) == (name == "ab")
    # What reads the key before the next checkpoint: nothing raised.
    assert store.load_ab([0]) == {0: {} if name == "ab" else {"e\x1fa\x1f": b"y" * 8}}
    assert store.read({0: ["q1"]}) == {0: [None if name == "queries" else b"r"]}
    assert store.expired({0: 100}, 10)[0][0] == ([] if name == "open" else ["q1"])
    assert store.commit([checkpoint(claimed.epoch, **full)]) == {}
    kinds = {"buckets": b"hash", "ab": b"hash", "queries": b"hash", "open": b"zset"}
    assert store.client.type(key) in (kinds[name], kinds[name].decode())
    again = store.claim(0)
    assert again.unreadable == () and again.offsets == {"imp": 5}
    assert again.buckets == {"a\x1f\x1f1": b"x"} and again.ab == {"e\x1fa\x1f": b"y" * 8}
    assert store.read({0: ["q1"]}) == {0: [b"r"]}


@pytest.mark.parametrize("name", ["offsets", "meta"])
def test_offsets_or_meta_of_another_type_leave_no_offset_and_a_fresh_epoch(store, name):
    """Review s11: the offsets, or the meta (the epoch, the layout history the buckets and
    records are read by, the last checkpoint's mark) of another type: the claim raised for
    ever. Now no offset is trusted (the partition is lost as for an unreadable offset:
    `serve --rebuild`); a meta of another type gets a fresh epoch that fences every earlier
    owner, distinct for two claims."""
    old = store.claim(0).epoch
    assert store.commit([checkpoint(old, offsets={"imp": 5}, meta={"mark": f"{old}:1"})]) == {}
    key = store._key(0, name)
    store.client.delete(key)
    store.client.set(key, "not a hash")
    loaded = store.load(0)  # read-only (`rankmeter report`): nothing written
    assert loaded.offsets == {} and ("key", name) in {(kind, field) for kind, field, _ in loaded.unreadable}
    assert store.client.type(key) in (b"string", "string")
    assert store.marks([0]) == {0: "" if name == "meta" else f"{old}:1"}
    claimed = store.claim(0)
    assert claimed.offsets == {} and ("key", name) in {(kind, field) for kind, field, _ in claimed.unreadable}
    if name == "meta":
        assert claimed.epoch > 1_000_000_000_000 and claimed.mark == ""
        assert store.commit([checkpoint(old, offsets={"imp": 6})]) == {0: FENCED}
        assert store.claim(0).epoch == claimed.epoch + 1
        claimed = store.claim(0)
    # `serve --rebuild`: the wipe deletes the key, a checkpoint of the claim's epoch is stored.
    assert store.wipe(0, claimed.epoch) is True
    assert store.commit([checkpoint(claimed.epoch, offsets={"imp": 1})]) == {}
    assert store.claim(0).offsets == {"imp": 1}


def test_a_meta_of_another_type_mid_run_fences_the_checkpoint_and_the_fenced_writes(store):
    """A meta replaced after the claim: the checkpoint is refused (no epoch is ours), nothing
    written and nothing raised; so are partition 0's holder's A/B writes."""
    owner = store.claim(0).epoch
    store.client.set(store._key(0, "meta"), "not a hash")
    assert store.commit([checkpoint(owner, offsets={"imp": 5}, records={"q1": b"r"})]) == {0: FENCED}
    assert store.client.exists(store._key(0, "queries")) == 0
    assert store.save_running("exp", {"P@10": "1"}, owner) is False
    assert store.append_look("exp", "a", 2, owner) is False
    assert store.looks("exp") == [] and store.load_running("exp") == {}
