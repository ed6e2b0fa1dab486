"""Given/when/then for the pure deciders, and a dict-backed `References`.

    def test_rename(given):
        given(CUSTOMER, CustomerRegistered("Ann", "ann@example.com")) \
            .when(RenameCustomer("Bea")) \
            .then(CustomerRenamed("Bea"))

The helpers are handed out as fixtures so the tests work under any pytest import mode.
`spark` is one local Spark session for the tests of Spark transforms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from pyspark.sql import SparkSession

from commands.errors import Rejected
from commands.registry import Aggregate
from events.base import DomainEvent


class FakeReferences:
    """`References` over a plain dict keyed by (aggregate_type, aggregate_id)."""

    def __init__(self, states: dict[tuple[str, str], object] | None = None) -> None:
        self.states: dict[tuple[str, str], object] = dict(states or {})

    def with_(self, aggregate_type: str, aggregate_id: str, state: object) -> FakeReferences:
        self.states[(aggregate_type, aggregate_id)] = state
        return self

    def get(self, aggregate_type: str, aggregate_id: str) -> object | None:
        return self.states.get((aggregate_type, aggregate_id))


@dataclass
class Outcome:
    events: list[DomainEvent] | None = None
    error: Rejected | None = None

    def then(self, *expected: DomainEvent) -> None:
        assert self.error is None, f"expected events, the command was rejected: {self.error!r}"
        assert self.events == list(expected)

    def then_rejected(
        self,
        code: str,
        *,
        message_contains: str | None = None,
        details: list[dict[str, Any]] | None = None,
    ) -> Rejected:
        assert self.error is not None, f"expected {code}, got events {self.events!r}"
        assert self.error.code == code
        if message_contains is not None:
            assert message_contains in self.error.message
        if details is not None:
            assert self.error.details == details
        return self.error


@dataclass
class Scenario:
    aggregate: Aggregate
    history: tuple[DomainEvent, ...]
    refs: FakeReferences = field(default_factory=FakeReferences)

    @property
    def state(self) -> Any:
        state = None
        for event in self.history:
            state = self.aggregate.evolve(state, event)
        return state

    def when(self, command: object) -> Outcome:
        try:
            return Outcome(events=self.aggregate.decide(self.state, command, self.refs))
        except Rejected as e:
            return Outcome(error=e)


Given = Callable[..., Scenario]


@pytest.fixture
def given() -> Given:
    def _given(
        aggregate: Aggregate, *history: DomainEvent, refs: FakeReferences | None = None
    ) -> Scenario:
        return Scenario(aggregate, history, refs if refs is not None else FakeReferences())

    return _given


@pytest.fixture
def refs() -> FakeReferences:
    return FakeReferences()


@pytest.fixture(scope="module")  # stopped after each module: integration tests need their own
def spark() -> Iterator[SparkSession]:
    """Logfold's own session (`spark.session.session`), on one core. Made the same way as the
    integration tests' sessions: the first session of a test run starts the JVM, and only jars
    given then (the Kafka connector) can be found by the sessions that follow."""
    from config.settings import Settings
    from spark.session import session as logfold_session

    settings = Settings(spark_master="local[1]", spark_shuffle_partitions=1)
    session = logfold_session(settings, "logfold-unit")
    yield session
    session.stop()
