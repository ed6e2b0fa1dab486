"""Kafka down: the API answers 503 with Retry-After in bounded time (commands, and reads that
ask Kafka for lag), writes nothing, and recovers by itself when the broker returns. Uses a
broker of its own, since it kills it."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from flask.testing import FlaskClient

from app import close_app, create_app
from app.commands_api import IDEMPOTENCY_NAMESPACE
from commands.processor import CommandProcessor
from config.settings import Settings
from stack.local_kafka import LocalKafka
from stack.procs import wait_until
from stack.topics import create_topics
from tests.support import log_of, token

AUTH = {"Authorization": f"Bearer {token(subject='outage')}"}


def register(client: FlaskClient, name: str, **extra: Any) -> Any:
    body = {"data": {"name": name, "email": f"{name}@example.com"}, **extra.pop("body", {})}
    return client.post("/commands/register-customer", json=body, headers={**AUTH, **extra})


def test_kafka_down_gives_503_writes_nothing_and_recovers(
    own_broker: LocalKafka, base_settings: Settings
) -> None:
    settings = base_settings.model_copy(
        update={
            "kafka_bootstrap_servers": own_broker.bootstrap,
            "kafka_timeout_s": 2.0,
            "command_timeout_s": 4.0,
        }
    )
    create_topics(settings)
    processor = CommandProcessor(settings)
    thread = threading.Thread(target=processor.run, daemon=True)
    thread.start()
    app = create_app(settings)
    client = app.test_client()
    try:
        assert register(client, "before").status_code == 201

        own_broker.proc.kill()  # type: ignore[union-attr]
        own_broker.proc.wait()  # type: ignore[union-attr]
        key = f"outage-{uuid.uuid4()}"
        r = register(client, "during", **{"Idempotency-Key": key})
        assert r.status_code == 503, r.json
        assert r.json["error"]["code"] == "unavailable"
        assert int(r.headers["Retry-After"]) > 0
        # Listing the views asks Kafka for their lag: unavailable too, never a 500.
        views = client.get("/views", headers=AUTH)
        assert views.status_code == 503, views.json
        assert (
            views.json["error"]["code"] == "unavailable"
            and "Kafka" in views.json["error"]["message"]
        )
        assert int(views.headers["Retry-After"]) > 0

        own_broker.start()
        answers: list[int] = []

        def accepted() -> bool:
            answers.append(register(client, "after").status_code)
            return answers[-1] == 201

        wait_until(accepted, 120, "the API to accept commands again", interval=0.5)
        assert set(answers) <= {201, 503, 504}, answers

        # Had the 503'd command been written, it would hold this aggregate id (derived from its
        # key) and be decided before any later command on the same partition.
        derived = str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"outage|register-customer|{key}"))
        # Its partition's writer may still be recovering from the outage: a 504 (no outcome
        # in time) is retried with the same key, as the API tells clients to.
        check = {"body": {"aggregate_id": derived}, "Idempotency-Key": f"check-{uuid.uuid4()}"}
        outcomes: list[Any] = []

        def decided() -> bool:
            outcomes.append(register(client, "during", **dict(check)))
            return bool(outcomes[-1].status_code != 504)

        wait_until(decided, 120, "an outcome for the command on the derived id", interval=0.5)
        again = outcomes[-1]
        assert again.status_code == 201 and again.json["version"] == 1, again.json
        names = [e.data["name"] for e in log_of(settings, "customer")]
        assert names.count("during") == 1 and names.count("before") == 1
    finally:
        processor.stop()
        thread.join(timeout=30)
        close_app(app)
