"""Command payloads as validated at the boundary (HTTP and the commands topic).

These pydantic models are the single source of truth for validation and for the OpenAPI
document; the registry turns a validated model into the domain's frozen command dataclass.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, EmailStr, Field

NO_CONTROL_CHARS = r"^[^\x00-\x1f\x7f]*$"  # Postgres text cannot hold NUL; names are one line
Name = Annotated[str, Field(min_length=1, max_length=200, pattern=NO_CONTROL_CHARS)]
Id = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
Cents = Annotated[int, Field(gt=0, le=10**9)]
Amount = Annotated[int, Field(gt=0, le=10**15)]


class Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RegisterCustomerData(Payload):
    name: Name
    email: EmailStr


class RenameCustomerData(Payload):
    name: Name


class ChangeCustomerEmailData(Payload):
    email: EmailStr


class AddBookData(Payload):
    title: Annotated[str, Field(min_length=1, max_length=300, pattern=NO_CONTROL_CHARS)]
    author: Name
    price_cents: Cents
    royalty_rate: Annotated[float, Field(ge=0, le=0.5, allow_inf_nan=False)]


class RepriceBookData(Payload):
    price_cents: Cents


class OrderLineData(Payload):
    book_id: Id
    quantity: Annotated[int, Field(ge=1, le=1000)]


class PlaceOrderData(Payload):
    customer_id: Id
    lines: Annotated[list[OrderLineData], Field(min_length=1, max_length=50)]


class PayOrderData(Payload):
    amount_cents: Amount


class ShipOrderData(Payload):
    pass


class CancelOrderData(Payload):
    reason: Annotated[str, Field(min_length=1, max_length=500, pattern=r"^[^\x00]*$")]


class CommandRequest(BaseModel):
    """The body of `POST /commands/<name>`; `data` is checked against the command's own model."""

    model_config = ConfigDict(extra="forbid", strict=True)

    aggregate_id: Id | None = None
    expected_version: Annotated[int, Field(ge=0)] | None = None
    data: dict[str, object] = Field(default_factory=dict)
