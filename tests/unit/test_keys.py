"""Sealing and opening personal fields (events/keys.py): pure, no key store."""

from __future__ import annotations

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from events.base import ERASED
from events.keys import PREFIX, is_sealed, open_value, seal


def test_a_sealed_value_opens_only_with_its_subjects_key_and_for_that_subject() -> None:
    key, other = AESGCM.generate_key(256), AESGCM.generate_key(256)
    sealed = seal(key, "customer:c1", "Ada Lovelace")
    assert is_sealed(sealed) and "Ada" not in sealed and sealed.startswith(PREFIX)
    assert seal(key, "customer:c1", "Ada Lovelace") != sealed  # a fresh nonce each time
    assert open_value(key, "customer:c1", sealed) == "Ada Lovelace"
    assert open_value(other, "customer:c1", sealed) == ERASED
    assert open_value(key, "customer:c2", sealed) == ERASED  # moved to another subject
    assert open_value(None, "customer:c1", sealed) == ERASED  # its key destroyed
    assert open_value(key, "customer:c1", PREFIX + "not base64!") == ERASED


def test_clear_values_and_others_pass_as_they_are() -> None:
    for value in ("Ada", None, 3, ""):
        assert not is_sealed(value)
        assert open_value(None, "customer:c1", value) == value


def test_a_key_store_out_of_reach_refuses_to_seal_as_unavailable() -> None:
    """The processor then answers 503 and writes nothing (commands/handling.py's STATUS)."""
    import pytest

    from commands.errors import Rejected
    from commands.keys import KeyStore
    from stack.procs import free_port

    store = KeyStore(f"postgresql://nobody@127.0.0.1:{free_port()}/none")
    with pytest.raises(Rejected) as refused:
        store.seal("customer:c1", {"name": "Ada"}, ("name",))
    assert refused.value.code == "unavailable"
