"""The messages a websocket client sends (`/ws`, protocol in docs/api.md), as they are checked,
and the errors a connection answers them with."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from commands.schemas import details

DEFAULT_WAIT_S, MAX_WAIT_S = 5.0, 30.0  # as REST's ?wait=

Scalar = str | int | float | bool | None


class Subscribe(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    op: str
    id: str = Field(min_length=1, max_length=64)
    view: str = Field(min_length=1, max_length=100)
    filter: dict[str, Scalar] = Field(default_factory=dict, max_length=16)
    since: str | None = Field(default=None, max_length=4096)  # a snapshot lists its xip
    # Read-your-writes: take the snapshot once the view includes this command position.
    consistent_with: str | None = Field(default=None, max_length=200)
    wait: float = Field(default=DEFAULT_WAIT_S, ge=0, le=MAX_WAIT_S)


class Unsubscribe(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    op: str
    id: str = Field(min_length=1, max_length=64)


class Problem(Exception):
    def __init__(self, code: str, message: str, sub_id: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.code, self.message, self.sub_id, self.details = code, message, sub_id, details


def parse(model: type[BaseModel], message: dict[str, Any]) -> Any:
    try:
        return model.model_validate(message)
    except ValidationError as e:
        problems = "; ".join(f"{d['field'] or 'message'}: {d['problem']}" for d in details(e))
        raise Problem("validation_failed", problems) from e
