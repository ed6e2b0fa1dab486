"""The Kafka topics Logfold owns (names in config/topics.py): their required configuration,
creating them, and the start-up check.

Every partitioned topic has the same partition count so that `partition_for(aggregate_id)` names
the same partition in each (see events.partitioning)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic
from kafka.errors import TopicAlreadyExistsError

from commands.handling import IDEMPOTENCY_RETENTION_S
from config.settings import CHANGELOG_SEGMENT_MS, Settings, kafka_client_options
from config.topics import Topics
from events.catalog import AGGREGATE_TYPES
from stack.procs import wait_until
from streams.registry import STREAMS

DAY_MS = 24 * 3600 * 1000
# Configurations where a larger value than the spec's only keeps records longer: fine.
AT_LEAST = ("min.compaction.lag.ms", "delete.retention.ms")
# Set when a topic is made, not checked: how soon compaction may run (changelogs made before
# these were set keep Kafka's defaults: an erasure then reaches them later, docs/operations.md).
NOT_CHECKED = ("segment.ms", "max.compaction.lag.ms")


@dataclass(frozen=True)
class TopicSpec:
    name: str
    purpose: str
    configs: dict[str, str] = field(default_factory=dict)
    partitions: int | None = None  # None: the deployment's partition count


def topic_specs(topics: Topics) -> list[TopicSpec]:
    """Every topic the deployment of `topics` owns, with its required configuration."""
    compact = {"cleanup.policy": "compact", "retention.ms": "-1", "min.compaction.lag.ms": "0"}
    changelog = {
        **compact,
        "min.compaction.lag.ms": str(topics.cdc_compaction_lag_ms),
        "delete.retention.ms": str(topics.cdc_delete_retention_ms),
        "segment.ms": str(CHANGELOG_SEGMENT_MS),
        "max.compaction.lag.ms": str(topics.cdc_compaction_lag_ms + CHANGELOG_SEGMENT_MS),
    }
    return [
        *(
            TopicSpec(topics.events(a), f"event log of {a} aggregates", compact)
            for a in AGGREGATE_TYPES
        ),
        TopicSpec(topics.snapshots, "write-model state per aggregate", compact),
        TopicSpec(
            topics.idempotency,
            "responses by Idempotency-Key",
            # As long as the processors remember a key (IDEMPOTENCY_RETENTION_S).
            {
                "cleanup.policy": "compact,delete",
                "retention.ms": str(int(IDEMPOTENCY_RETENTION_S * 1000)),
            },
        ),
        TopicSpec(
            topics.command_offsets,
            "where each partition's command processing resumes (written in its transactions)",
            compact,
        ),
        TopicSpec(
            topics.commands,
            "commands waiting for their partition's processor",
            {"cleanup.policy": "delete", "retention.ms": str(DAY_MS)},
        ),
        TopicSpec(
            topics.replies,
            "command outcomes for the API process waiting on them",
            {"cleanup.policy": "delete", "retention.ms": str(3600 * 1000)},
        ),
        TopicSpec(
            topics.projector_rows,
            "each event's view rows, from the projector's real-time query to its writer",
            # Read as they are written, by the process that writes them.
            {"cleanup.policy": "delete", "retention.ms": str(3600 * 1000)},
        ),
        TopicSpec(
            topics.join_rows,
            "each changelog record, from the projector's real-time joins query to its writer",
            {"cleanup.policy": "delete", "retention.ms": str(3600 * 1000)},
        ),
        # Append-only; kept for good, so every view over a stream can be rebuilt from it.
        *(
            TopicSpec(
                topics.stream(name),
                f"records of the {name} stream",
                {"cleanup.policy": "delete", "retention.ms": "-1"},
            )
            for name in STREAMS
        ),
        # One partition: a table's changelog is one total order (commit order), which is
        # what websocket positions and `since` rely on. Every change is kept a while
        # (compaction then keeps each key's last), and deletes a while longer, so that a
        # reader behind by less misses none (LOGFOLD_CDC_COMPACTION_LAG_MS and
        # LOGFOLD_CDC_DELETE_RETENTION_MS, in config/settings.py).
        *(
            TopicSpec(topics.cdc(t), f"changelog of table {t}", changelog, partitions=1)
            for t in captured_tables()
        ),
    ]


def topic_spec(topics: Topics, name: str) -> TopicSpec:
    """The spec of the topic called `name`; KeyError if Logfold owns no such topic."""
    for found in topic_specs(topics):
        if found.name == name:
            return found
    raise KeyError(name)


def captured_tables() -> list[str]:
    from projections.registry import CAPTURED  # every view module (no Spark), on first use

    return list(CAPTURED)


class TopicMisconfigured(RuntimeError):
    pass


def admin_client(settings: Settings) -> KafkaAdminClient:
    return KafkaAdminClient(
        bootstrap_servers=settings.kafka(),
        **kafka_client_options(),
        client_id="logfold-admin",
        request_timeout_ms=int(settings.kafka_timeout_s * 1000),
    )


def create_topics(settings: Settings) -> list[str]:
    """Create missing topics with the required configuration; return the names created."""
    topics = Topics.of(settings)
    admin = admin_client(settings)
    try:
        existing = set(admin.list_topics())
        missing = [s for s in topic_specs(topics) if s.name not in existing]
        created = []
        for spec in missing:
            try:
                admin.create_topics(
                    [
                        NewTopic(
                            spec.name,
                            spec.partitions or settings.partitions,
                            settings.replication_factor,
                            topic_configs=spec.configs,
                        )
                    ]
                )
                created.append(spec.name)
            except TopicAlreadyExistsError:
                pass
        if missing:
            # Leaders are elected asynchronously; users of the topics need them ready.
            wait_for_topics(admin, [s.name for s in missing], timeout_s=30.0)
        return created
    finally:
        admin.close()


def check_topics(settings: Settings) -> None:
    """Raise TopicMisconfigured, naming every problem and its fix, unless every topic exists
    with the expected partition count and configuration."""
    topics = Topics.of(settings)
    specs = topic_specs(topics)
    admin = admin_client(settings)
    try:
        described = {t["topic"]: t for t in admin.describe_topics([s.name for s in specs])}
        problems = []
        present = []
        for spec in specs:
            topic = described.get(spec.name)
            if topic is None or topic.get("error_code", 0) != 0:
                problems.append(f"topic {spec.name} is missing (run `logfold topics --create`)")
                continue
            present.append(spec)
            count = len(topic["partitions"])
            if spec.partitions is not None and count != spec.partitions:
                problems.append(
                    f"topic {spec.name} has {count} partitions, expected {spec.partitions}"
                )
            elif spec.partitions is None and count != settings.partitions:
                problems.append(
                    f"topic {spec.name} has {count} partitions, expected {settings.partitions} "
                    "(LOGFOLD_PARTITIONS); all Logfold topics must share one partition count"
                )
        if present:
            configs = topic_configs(admin, [s.name for s in present])
            for spec in present:
                actual = configs.get(spec.name, {})
                for key, want in spec.configs.items():
                    if key in NOT_CHECKED:
                        continue
                    have = str(actual.get(key))
                    if key in AT_LEAST and _at_least(have, want):
                        continue
                    if key not in AT_LEAST and _normalized(have) == _normalized(want):
                        continue
                    expected = f"{key}={want}" + (" or more" if key in AT_LEAST else "")
                    problems.append(
                        f"topic {spec.name} has {key}={have}, expected {expected} "
                        f"(fix: kafka-configs --alter --entity-type topics "
                        f"--entity-name {spec.name} --add-config {key}={want})"
                    )
        if problems:
            raise TopicMisconfigured(
                "Kafka topics are not configured as Logfold requires:\n  - "
                + "\n  - ".join(problems)
            )
    finally:
        admin.close()


def wait_for_topics(admin: KafkaAdminClient, names: list[str], timeout_s: float) -> None:
    """Return once every partition of every named topic has a leader; leaders are elected
    asynchronously after a topic is created, and its users need them."""

    def led() -> bool:
        described = {t["topic"]: t for t in admin.describe_topics(names)}
        return all(
            (topic := described.get(name)) is not None
            and topic.get("error_code", 0) == 0
            and topic["partitions"]
            and all(p["leader"] >= 0 for p in topic["partitions"])
            for name in names
        )

    wait_until(led, timeout_s, f"a leader for every partition of {sorted(names)}")


def topic_configs(admin: KafkaAdminClient, names: list[str]) -> dict[str, dict[str, str | None]]:
    """Every configuration value of each named topic, defaults included, by topic and key."""
    resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
    configs: dict[str, dict[str, str | None]] = {}
    for response in admin.describe_configs(resources):
        for resource in response.to_object()["resources"]:
            configs[resource["resource_name"]] = {
                entry["config_names"]: entry["config_value"] for entry in resource["config_entries"]
            }
    return configs


def _normalized(value: str) -> str:
    return ",".join(sorted(value.split(",")))


def _at_least(have: str, want: str) -> bool:
    return have.lstrip("-").isdigit() and int(have) >= int(want)
