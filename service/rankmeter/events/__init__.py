"""The event model: impressions and feedback, native or OpenSearch UBI, decoded and checked.

`Decoder.impression(value)` and `Decoder.feedback(value)` turn one Kafka message value
into an `Impression`, a `Feedback`, or a `Rejected` (with the outcome, `invalid` or
`ignored`, and a reason a person can act on). Brief §2 and §3 are the contract.

Modules: `model` (what the pipeline works with), `wire` (what arrives on the wire),
`rules` (the limits and grades every event is checked against, whatever its shape),
`ubi` (OpenSearch UBI records), `decoder` (native messages, and the dispatch to UBI).
"""

from rankmeter.events.decoder import Decoder
from rankmeter.events.model import IMPRESSION_ACTION, Feedback, Impression, Rejected
from rankmeter.events.rules import event_time_ms, query_hash
from rankmeter.events.wire import UBI_QUERY_KEYS

__all__ = ["IMPRESSION_ACTION", "UBI_QUERY_KEYS", "Decoder", "Feedback", "Impression", "Rejected",
           "event_time_ms", "query_hash"]
