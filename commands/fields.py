"""What a command is, and the vocabulary its fields are declared with: standard library only.

A command is a frozen dataclass deriving from `Command`, defined once, in its aggregate's
module. Its fields carry their constraints as `Annotated` metadata (`Text`, `Email`, `Number`,
`Items`); the HTTP boundary derives its validation and OpenAPI schema from them
(`commands/schemas.py`), and the aggregate decides on the dataclass itself."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, ClassVar


class Command:
    """Base of every command. Its name on the wire is the class name in kebab case
    (`RenameCustomer` → `rename-customer`); its summary is its docstring's first line."""

    creates: ClassVar[bool] = False  # True: it makes a new aggregate (no aggregate_id needed)
    scope: ClassVar[str] = "commands:write"  # the token scope that may send it

    @classmethod
    def wire_name(cls) -> str:
        return re.sub(r"(?<!^)(?=[A-Z])", "-", cls.__name__).lower()

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or cls.__name__).strip().splitlines()[0]


@dataclass(frozen=True)
class Text:
    max_length: int
    min_length: int = 1
    pattern: str | None = None


@dataclass(frozen=True)
class Email:
    """An email address, as `email-validator` accepts it."""


@dataclass(frozen=True)
class Number:
    gt: float | None = None
    ge: float | None = None
    le: float | None = None


@dataclass(frozen=True)
class Items:
    """Bounds of a sequence's length."""

    min_length: int
    max_length: int


ONE_LINE = r"^[^\x00-\x1f\x7f]*$"  # Postgres text cannot hold NUL; names are one line

Name = Annotated[str, Text(max_length=200, pattern=ONE_LINE)]
Id = Annotated[str, Text(max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
EmailAddress = Annotated[str, Email()]
Cents = Annotated[int, Number(gt=0, le=10**9)]
Amount = Annotated[int, Number(gt=0, le=10**15)]
