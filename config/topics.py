"""The names of the Kafka topics a deployment owns (a prefix lets several share a cluster).

Their required configuration, and creating and checking them, belong to the roof
(stack/topics.py): those need every registry."""

from __future__ import annotations

from kafka import TopicPartition

from config.settings import CHANGELOG_KEEP_MS, Settings


class Topics:
    """Topic names for one deployment (a prefix lets several share a cluster)."""

    def __init__(
        self,
        prefix: str = "",
        cdc_compaction_lag_ms: int = CHANGELOG_KEEP_MS,
        cdc_delete_retention_ms: int = CHANGELOG_KEEP_MS,
    ) -> None:
        self.prefix = prefix
        self.cdc_compaction_lag_ms = cdc_compaction_lag_ms
        self.cdc_delete_retention_ms = cdc_delete_retention_ms

    @classmethod
    def of(cls, settings: Settings) -> Topics:
        """The topics of the deployment `settings` describe, with its changelogs' retention."""
        return cls(
            settings.topic_prefix, settings.cdc_compaction_lag_ms, settings.cdc_delete_retention_ms
        )

    def events(self, aggregate_type: str) -> str:
        return f"{self.prefix}events.{aggregate_type}"

    @property
    def commands(self) -> str:
        return f"{self.prefix}commands"

    @property
    def replies(self) -> str:
        return f"{self.prefix}replies"

    @property
    def snapshots(self) -> str:
        return f"{self.prefix}snapshots"

    @property
    def idempotency(self) -> str:
        return f"{self.prefix}idempotency"

    @property
    def command_offsets(self) -> str:
        return f"{self.prefix}command-offsets"

    @property
    def processor_group(self) -> str:
        return f"{self.prefix}logfold-command-processors"

    def transactional_id(self, partition: int) -> str:
        return f"{self.prefix}logfold-command-partition-{partition}"

    def stream(self, name: str) -> str:
        return f"{self.prefix}streams.{name}"

    @property
    def projector_rows(self) -> str:
        return f"{self.prefix}projector-rows"

    @property
    def join_rows(self) -> str:
        return f"{self.prefix}join-rows"

    def cdc(self, table: str) -> str:
        return f"{self.prefix}cdc.{table}"

    def table_of(self, cdc_topic: str) -> str:
        return cdc_topic.removeprefix(f"{self.prefix}cdc.")


def partition_of(key: str) -> TopicPartition:
    """The partition an offsets key ("topic:partition", as progress records them) names."""
    topic, _, partition = key.rpartition(":")
    return TopicPartition(topic, int(partition))
