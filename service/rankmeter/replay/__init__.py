"""`rankmeter replay`: logged OpenSearch UBI data into rankmeter.

Reads OpenSearch bulk ndjson (the UBI data generator's `--generate-ndjson`, `_bulk`
exports), plain ndjson, or the generator's CSVs (`formats.py`), and produces every record
to the impressions or feedback topic, keyed by its `query_id`, with its event time as the
Kafka record timestamp (`producing.py`) — or, embedded, runs the pipeline on them
in-process and evaluates (`evaluating.py`).

A bad record (broken JSON, no query_id, an unknown index, …) is skipped, counted and
reported by FILE:LINE (`summary.py`); the rest goes through. Records are sent in file
order: the pipeline joins out-of-order queries and feedback as it does live.
"""

from rankmeter.replay.evaluating import Evaluated, embedded, evaluate, iso, outcomes_text
from rankmeter.replay.formats import FORMATS, Input, open_inputs, query_event, ubi_event
from rankmeter.replay.judgments import Judgments, judgment_events, load_judgments
from rankmeter.replay.messages import FEEDBACK, IMPRESSIONS, Message, Skipped, index_stream, recognise
from rankmeter.replay.producing import KafkaSink, Send, replay, topic_names
from rankmeter.replay.summary import Progress, Summary

__all__ = ["FEEDBACK", "FORMATS", "IMPRESSIONS", "Evaluated", "Input", "Judgments", "KafkaSink", "Message",
           "Progress", "Send", "Skipped", "Summary", "embedded", "evaluate", "index_stream", "iso",
           "judgment_events", "load_judgments", "open_inputs", "outcomes_text", "query_event", "recognise",
           "replay", "topic_names", "ubi_event"]
