"""The registry client's settings: secrets never shown, by the same rule as the [kafka] table plus the
registry's own user-info setting and a password in the URL."""

from __future__ import annotations

import pytest

from worker.exceptions import ConfigError
from worker.formats.registry import RegistryConfig, framed_schema_id, redact_registry_text, redacted_registry_settings, registry_client

SETTINGS = {"basic.auth.user.info": "decider:pw-1", "bearer.auth.token": "tok-2", "bearer.auth.client.secret": "sec-3",
            "ssl.ca.location": "/etc/ca.pem", "timeout": 5}


def test_secrets_are_redacted_in_settings_and_text():
    shown = redacted_registry_settings(SETTINGS)
    assert shown == {"basic.auth.user.info": "[redacted]", "bearer.auth.token": "[redacted]",
                     "bearer.auth.client.secret": "[redacted]", "ssl.ca.location": "/etc/ca.pem", "timeout": 5}
    text = "auth decider:pw-1 failed with tok-2 and sec-3 at http://u:pw-4@registry:8081"
    assert redact_registry_text(text, "http://u:pw-4@registry:8081", SETTINGS) == (
        "auth [redacted] failed with [redacted] and [redacted] at http://u:[redacted]@registry:8081")
    assert RegistryConfig("http://u:pw-4@registry:8081").shown_url() == "http://u:[redacted]@registry:8081"


def test_client_settings_are_checked():
    assert registry_client("mock://x", {"timeout": 5}) is not None
    with pytest.raises(ConfigError, match="must not set url"):
        registry_client("http://r:8081", {"url": "http://other"})
    with pytest.raises(ConfigError, match="--schema-registry-url is empty"):
        registry_client("")


def test_framed_schema_id():
    assert framed_schema_id(b"\x00\x00\x00\x01\x02\x10x") == 258
    assert framed_schema_id(b"\x00\x00\x00\x01\x02") is None  # framing alone, no payload
    assert framed_schema_id(b"{}") is None
