"""Command payloads as validated at the HTTP boundary, derived from the commands themselves.

`payload_model(RenameCustomer)` is the pydantic model of `rename-customer`'s `data`: one field
per dataclass field, its constraints read from the field's `commands.fields` metadata. It
serves validation and the OpenAPI document; nothing here is written by hand per command."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, EmailStr, Field, ValidationError, create_model

from commands.fields import Email, Id, Items, Number, Text


class Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


@functools.cache
def payload_model(cls: type) -> type[BaseModel]:
    """The pydantic model of a command (or a dataclass inside one), named `<Class>Data`."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields: dict[str, Any] = {
        f.name: (_pydantic_type(hints[f.name]), ...) for f in dataclasses.fields(cls)
    }
    return create_model(f"{cls.__name__}Data", __base__=Payload, **fields)


def _pydantic_type(tp: Any) -> Any:
    if typing.get_origin(tp) is Annotated:
        base, *marks = typing.get_args(tp)
        constraints: dict[str, Any] = {}
        for mark in marks:
            if isinstance(mark, Email):
                base = EmailStr
            elif isinstance(mark, Text | Number | Items):
                constraints |= {k: v for k, v in dataclasses.asdict(mark).items() if v is not None}
        if base is float:
            constraints["allow_inf_nan"] = False
        return Annotated[_pydantic_type(base), Field(**constraints)]
    if typing.get_origin(tp) is tuple:  # tuple[X, ...]: a JSON array
        return list[_pydantic_type(typing.get_args(tp)[0])]  # type: ignore[misc]
    if dataclasses.is_dataclass(tp):
        return payload_model(tp)  # type: ignore[arg-type]
    return tp


def details(e: ValidationError, prefix: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """pydantic's errors as the contract's `details`: `{"field": "data.lines.0.quantity",
    "problem": "..."}` (docs/api.md); the one place that turns one into the other."""
    return [
        {"field": ".".join(str(p) for p in (*prefix, *err["loc"])), "problem": err["msg"]}
        for err in e.errors()
    ]


if TYPE_CHECKING:
    WireId = str
else:
    WireId = _pydantic_type(Id)


class CommandRequest(BaseModel):
    """The body of `POST /commands/<name>`; `data` is checked against the command's own model."""

    model_config = ConfigDict(extra="forbid", strict=True)

    aggregate_id: WireId | None = None
    expected_version: Annotated[int, Field(ge=0)] | None = None
    data: dict[str, object] = Field(default_factory=dict)
