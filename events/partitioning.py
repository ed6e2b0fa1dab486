"""Which partition an aggregate lives in. Every partitioned topic (commands, events, snapshots,
idempotency) has the same partition count and uses this function, so one aggregate's commands,
events and state share a partition number and a single writer."""

from __future__ import annotations

from kafka.partitioner.default import murmur2


def partition_for(aggregate_id: str, partitions: int) -> int:
    """The Java client's default partitioner applied to the aggregate id alone."""
    return int(murmur2(aggregate_id.encode()) & 0x7FFFFFFF) % partitions
