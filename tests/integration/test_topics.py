"""The start-up topic check: a deployment whose topics are missing, mis-partitioned or wrongly
configured is refused with a message that names the topic and the fix, and the CLI will not
start on it."""

from __future__ import annotations

import subprocess
import uuid

import pytest
from kafka.admin import KafkaAdminClient, NewTopic

from config.settings import Settings
from config.topics import Topics
from stack.topics import (
    TopicMisconfigured,
    captured_tables,
    check_topics,
    create_topics,
    topic_configs,
    topic_specs,
    wait_for_topics,
)
from tests.support import cli as run_cli

CLI_TIMEOUT_S = 90


def fresh(base: Settings) -> Settings:
    """Settings for a prefix that has no topics yet."""
    return base.model_copy(update={"topic_prefix": f"x{uuid.uuid4().hex[:10]}."})


def make_topics(
    settings: Settings,
    skip: str | None = None,
    partitions: dict[str, int] | None = None,
    configs: dict[str, dict[str, str]] | None = None,
) -> Topics:
    """Create the deployment's topics by hand: all but `skip`, with some partition counts or
    configs overridden, and wait until the broker's metadata shows them."""
    topics = Topics(settings.topic_prefix)
    wanted = [
        NewTopic(
            spec.name,
            (partitions or {}).get(spec.name, spec.partitions or settings.partitions),
            settings.replication_factor,
            topic_configs={**spec.configs, **(configs or {}).get(spec.name, {})},
        )
        for spec in topic_specs(topics)
        if spec.name != skip
    ]
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka(), request_timeout_ms=30000)
    try:
        admin.create_topics(wanted)
        wait_for_topics(admin, [t.name for t in wanted], timeout_s=30.0)
    finally:
        admin.close()
    return topics


def problems_of(settings: Settings) -> str:
    with pytest.raises(TopicMisconfigured) as raised:
        check_topics(settings)
    message = str(raised.value)
    assert message.startswith("Kafka topics are not configured as Logfold requires")
    return message


def problem_lines(message: str) -> list[str]:
    return [line.strip()[2:] for line in message.splitlines()[1:]]


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(settings, *args, timeout=CLI_TIMEOUT_S)


def test_a_correctly_created_deployment_passes(deployment: Settings) -> None:
    # Right after create_topics (in new_deployment): it returns only once the topics are usable.
    check_topics(deployment)


def test_topics_made_to_the_spec_by_hand_pass(base_settings: Settings) -> None:
    settings = fresh(base_settings)
    make_topics(settings)
    check_topics(settings)


def test_a_missing_topic_is_named_with_the_command_that_creates_it(
    base_settings: Settings,
) -> None:
    settings = fresh(base_settings)
    replies = Topics(settings.topic_prefix).replies
    make_topics(settings, skip=replies)
    message = problems_of(settings)
    assert problem_lines(message) == [f"topic {replies} is missing (run `logfold topics --create`)"]


def test_a_deployment_with_no_topics_lists_every_one(base_settings: Settings) -> None:
    settings = fresh(base_settings)
    message = problems_of(settings)
    names = [spec.name for spec in topic_specs(Topics(settings.topic_prefix))]
    assert len(problem_lines(message)) == len(names)
    for name in names:
        assert f"topic {name} is missing" in message


def test_an_events_topic_with_delete_cleanup_is_named_with_the_fix(
    base_settings: Settings,
) -> None:
    settings = fresh(base_settings)
    orders = Topics(settings.topic_prefix).events("order")
    make_topics(settings, configs={orders: {"cleanup.policy": "delete"}})
    message = problems_of(settings)
    assert problem_lines(message) == [
        f"topic {orders} has cleanup.policy=delete, expected cleanup.policy=compact "
        f"(fix: kafka-configs --alter --entity-type topics --entity-name {orders} "
        f"--add-config cleanup.policy=compact)"
    ]


def test_a_topic_with_another_partition_count_is_named(base_settings: Settings) -> None:
    settings = fresh(base_settings)
    commands = Topics(settings.topic_prefix).commands
    make_topics(settings, partitions={commands: settings.partitions + 2})
    message = problems_of(settings)
    [line] = problem_lines(message)
    assert line.startswith(
        f"topic {commands} has {settings.partitions + 2} partitions, "
        f"expected {settings.partitions} (LOGFOLD_PARTITIONS)"
    )


def test_settings_with_another_partition_count_flag_every_partitioned_topic(
    deployment: Settings,
) -> None:
    other = deployment.model_copy(update={"partitions": deployment.partitions * 2})
    message = problems_of(other)
    # Changelogs have one partition whatever the setting: a table's changes are one order.
    specs = topic_specs(Topics(deployment.topic_prefix))
    names = [spec.name for spec in specs if spec.partitions is None]
    assert [s.name for s in specs if s.partitions == 1] == [
        Topics(deployment.topic_prefix).cdc(t) for t in captured_tables()
    ]
    lines = problem_lines(message)
    assert len(lines) == len(names)
    for name, line in zip(names, lines, strict=True):
        assert line.startswith(
            f"topic {name} has {deployment.partitions} partitions, "
            f"expected {other.partitions} (LOGFOLD_PARTITIONS)"
        )


def test_the_cli_checks_a_good_deployment_and_lists_its_topics(deployment: Settings) -> None:
    done = cli(deployment, "topics")
    assert done.returncode == 0, done.stderr
    for spec in topic_specs(Topics(deployment.topic_prefix)):
        assert f"ok  {spec.name}" in done.stdout


@pytest.mark.parametrize("command", ["processor", "topics"])
def test_the_cli_refuses_to_start_on_a_misconfigured_deployment(
    base_settings: Settings, command: str
) -> None:
    settings = fresh(base_settings)
    topics = Topics(settings.topic_prefix)
    customers = topics.events("customer")
    make_topics(settings, skip=topics.snapshots, configs={customers: {"cleanup.policy": "delete"}})
    done = cli(settings, command)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "error: Kafka topics are not configured as Logfold requires" in done.stderr
    assert f"topic {topics.snapshots} is missing (run `logfold topics --create`)" in done.stderr
    assert f"topic {customers} has cleanup.policy=delete" in done.stderr
    assert "Traceback" not in done.stderr


def test_topics_create_repairs_a_missing_topic(base_settings: Settings) -> None:
    settings = fresh(base_settings)
    topics = Topics(settings.topic_prefix)
    make_topics(settings, skip=topics.idempotency)
    done = cli(settings, "topics", "--create")
    assert done.returncode == 0, done.stderr
    assert f"created {topics.idempotency}" in done.stdout
    check_topics(settings)


def test_changelogs_keep_every_change_and_then_deletes_for_the_configured_time(
    base_settings: Settings,
) -> None:
    """A changelog reader (the websocket hub, a join) further behind than compaction allows
    can miss a change or a delete: changelogs keep both for LOGFOLD_CDC_COMPACTION_LAG_MS and
    LOGFOLD_CDC_DELETE_RETENTION_MS, and a changelog that keeps them for less is refused."""
    settings = fresh(base_settings).model_copy(
        update={"cdc_compaction_lag_ms": 3_600_000, "cdc_delete_retention_ms": 7_200_000}
    )
    customers = Topics(settings.topic_prefix).cdc("customers")
    create_topics(settings)
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka(), request_timeout_ms=30000)
    try:
        configs = topic_configs(admin, [customers])[customers]
    finally:
        admin.close()
    assert (configs["min.compaction.lag.ms"], configs["delete.retention.ms"]) == (
        "3600000",
        "7200000",
    )
    check_topics(settings)
    check_topics(settings.model_copy(update={"cdc_compaction_lag_ms": 60_000}))  # more is fine
    longer = problem_lines(
        problems_of(settings.model_copy(update={"cdc_delete_retention_ms": 8_000_000}))
    )
    assert len(longer) == len(captured_tables())  # each changelog keeps its deletes too briefly
    assert f"topic {customers} has delete.retention.ms=7200000, expected " in "\n".join(longer)

    # A changelog compacted at once (as they were made before): refused, with the fix.
    immediate = fresh(base_settings)
    cdc = Topics(immediate.topic_prefix).cdc("customers")
    make_topics(immediate, configs={cdc: {"min.compaction.lag.ms": "0"}})
    assert problem_lines(problems_of(immediate)) == [
        f"topic {cdc} has min.compaction.lag.ms=0, expected min.compaction.lag.ms=86400000 "
        f"or more (fix: kafka-configs --alter --entity-type topics --entity-name {cdc} "
        f"--add-config min.compaction.lag.ms=86400000)"
    ]
