"""`/asyncapi.json` (guarantees 22-23's contract): the AsyncAPI project's own parser accepts it,
and every message type the server sends, on every protocol, is in it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from app.asyncapi import STREAMED, build

CONTRACTS = Path(__file__).resolve().parents[1] / "contracts"
SENDERS = ["app/hub.py", "app/ws_api.py", "app/feeds_api.py", "app/subscribing.py"]
REPO = Path(__file__).resolve().parents[2]


def parse(document: dict[str, Any]) -> dict[str, Any]:
    node = shutil.which("node")
    if node is None or not (CONTRACTS / "node_modules" / "@asyncapi" / "parser").exists():
        pytest.fail("the AsyncAPI parser is missing: run scripts/bootstrap.sh (npm ci)")
    done = subprocess.run(
        [node, str(CONTRACTS / "parse-asyncapi.mjs")],
        input=json.dumps(document),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def sent_types() -> set[str]:
    """The `type` of every message the server's push code builds (as dicts or as text)."""
    found: set[str] = set()
    for path in SENDERS:
        text = (REPO / path).read_text()
        found |= set(re.findall(r"""["']type["']\s*:\s*["']([a-z_]+)["']""", text))
        found |= set(re.findall(r"""\\?"type\\?":\\?"([a-z_]+)""", text))
    return {t for t in found if not t.startswith("_")}  # `_…`: the server's own, never sent


def test_the_parser_accepts_the_document_with_no_diagnostic() -> None:
    parsed = parse(build("127.0.0.1:8000", "0.1.0"))
    assert parsed["valid"], parsed["diagnostics"]
    assert parsed["diagnostics"] == []


def test_the_parser_catches_a_broken_document() -> None:
    """The check can fail: a document without `info` and with a dangling reference."""
    document = build("127.0.0.1:8000", "0.1.0")
    del document["info"]
    document["channels"]["websocket"]["messages"]["server_change"]["$ref"] = "#/nope"
    parsed = parse(document)
    assert not parsed["valid"]
    assert len([d for d in parsed["diagnostics"] if d["severity"] == "error"]) >= 2


def test_every_message_the_server_sends_is_in_the_document() -> None:
    channels = parse(build("127.0.0.1:8000", "0.1.0"))["channels"]
    types = sent_types()
    assert {"change", "snapshot", "resync", "error", "lagging"} <= types  # the scan finds them
    missing = types - set(channels["websocket"])
    assert not missing, f"sent over /ws but not in /asyncapi.json: {missing}"
    assert set(STREAMED) <= set(channels["viewEvents"])
    streamed = {t for t in types if t not in ("subscribed", "unsubscribed", "heartbeat")}
    assert streamed <= set(channels["viewEvents"]), streamed - set(channels["viewEvents"])
    assert channels["webhookDeliveries"] == ["change"]
