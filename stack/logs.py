"""Structured logs: one JSON object per line on stderr."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # kafka-python is chatty at INFO about every connection.
    logging.getLogger("kafka").setLevel(logging.WARNING)
    logging.getLogger("kafka.coordinator.consumer").setLevel(logging.ERROR)
    # py4j logs every callback from the JVM (each Spark micro-batch) at INFO.
    logging.getLogger("py4j").setLevel(logging.WARNING)
