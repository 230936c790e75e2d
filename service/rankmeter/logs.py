"""Structured logs: one JSON object per line on stderr, with any `extra=` fields."""

from __future__ import annotations

import json
import logging
import sys
import time

from rankmeter.redaction import redact

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


_said: set[tuple[str, str]] = set()


def error_once(logger: logging.Logger, msg: str, **extra: object) -> None:
    """Logs `msg` at the first call only, per logger and message: a stored value that is
    unreadable is met at every look, and one line says it (the counters count the rest)."""
    if (logger.name, msg) not in _said:
        _said.add((logger.name, msg))
        logger.error(msg, extra=extra)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            # Our own failures with their traceback; a library's (kafka-python logs every
            # connection reset with one) as the exception alone: an outage is not a bug.
            ours = record.name.split(".")[0] == "rankmeter"
            error = record.exc_info[1]
            entry["error"] = self.formatException(record.exc_info) if ours or error is None else \
                f"{type(error).__name__}: {error}"
        # Any line, ours or a library's (kafka-python dumps its config at DEBUG), loses its secrets.
        return redact(json.dumps(entry, default=str))


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python is chatty at INFO
