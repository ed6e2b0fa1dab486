"""The one place that says which streams exist: a record type and the field it is partitioned
by, one line each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from streams.page_views import PageView

if TYPE_CHECKING:
    from pydantic import BaseModel


@dataclass(frozen=True)
class Stream:
    name: str
    record_type: type
    key: str  # the field of `data` that picks the partition (records of one key stay in order)

    @property
    def summary(self) -> str:
        return (self.record_type.__doc__ or self.name).strip().splitlines()[0]

    @property
    def schema(self) -> type[BaseModel]:
        """The pydantic model of a record's `data` (validation and OpenAPI; built once)."""
        from commands.schemas import payload_model

        return payload_model(self.record_type)


STREAMS: dict[str, Stream] = {
    s.name: s for s in (Stream("page_views", PageView, key="customer_id"),)
}
