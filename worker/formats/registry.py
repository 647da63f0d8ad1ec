"""The Schema Registry client decider uses (confluent-kafka's own ``SchemaRegistryClient``), built from
``--schema-registry-url`` and the config file's ``[schema_registry]`` table, with its secrets kept out of
every message the way ``worker.config_file`` keeps the ``[kafka]`` secrets out.

``mock://...`` URLs give confluent-kafka's in-process mock registry (tests in one process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlsplit

from worker.exceptions import ConfigError
from worker.config_file import REDACTED, REGISTRY_TABLE, is_secret, redact_text
# Secrets the [kafka] rule (worker.config_file.is_secret) does not recognise by name: "user:password".
_USER_INFO_KEYS = frozenset({"basic.auth.user.info"})


def secret_settings(url: str | None, settings: Mapping[str, Any]) -> dict[str, str]:
    """The secret values among the registry settings (and a password in the URL), under names that
    ``worker.config_file.is_secret`` recognises, so its ``redact``/``redact_text`` apply unchanged."""
    secrets = {f"secret:{key}": str(value) for key, value in settings.items() if is_registry_secret(key)}
    if url:
        password = urlsplit(url).password
        if password:
            secrets["secret:url.password"] = password
    return secrets


def is_registry_secret(key: str) -> bool:
    """True for registry settings whose value must never be shown."""
    return is_secret(key) or key in _USER_INFO_KEYS


def redact_registry_text(text: str, url: str | None, settings: Mapping[str, Any]) -> str:
    """``text`` with every registry secret replaced (for logs and error messages)."""
    return redact_text(text, secret_settings(url, settings))


def redacted_registry_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The registry settings as they may be logged."""
    return {key: (REDACTED if is_registry_secret(key) else value) for key, value in settings.items()}


def registry_client(url: str, settings: Mapping[str, Any] | None = None) -> Any:
    """A ``SchemaRegistryClient`` for ``url`` (``mock://`` gives the in-process mock); ``ConfigError`` if the
    settings are not ones the client knows."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    settings = dict(settings or {})
    if not url:
        raise ConfigError("--schema-registry-url is empty; give the registry's URL, e.g. http://schema-registry:8081")
    if "url" in settings:
        raise ConfigError(f"[{REGISTRY_TABLE}] must not set url; use --schema-registry-url")
    try:
        return SchemaRegistryClient.new_client({"url": url, **settings})
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"[{REGISTRY_TABLE}]: {redact_registry_text(str(exc), url, settings)}") from None
    except OSError as exc:  # a certificate or key file named by the ssl.* settings cannot be read
        files = ", ".join(f"{k} = {v}" for k, v in settings.items() if k.startswith("ssl.") and not is_registry_secret(k))
        raise ConfigError(f"[{REGISTRY_TABLE}]: cannot read a file of {files or 'the ssl settings'}: {exc.strerror}") from None


def framed_schema_id(value: bytes) -> int | None:
    """The schema id of a Confluent-framed value (magic byte 0, then a big-endian int32), or None."""
    if len(value) > 5 and value[0] == 0:
        return int.from_bytes(value[1:5], "big")
    return None


def transport_errors() -> tuple[type[BaseException], ...]:
    """The exception types the client raises when the registry cannot be reached (refused, DNS, timeout)."""
    try:  # the client's own httpx flavour (httpx2 on newer releases)
        from confluent_kafka.schema_registry.common._httpx_compat import httpx
    except ImportError:  # pragma: no cover - older confluent-kafka releases use httpx directly
        import httpx
    return (httpx.TransportError,)


@dataclass(frozen=True)
class RegistryConfig:
    """Where the Schema Registry is and how to talk to it: ``--schema-registry-url``, ``[schema_registry]``
    client settings, and whether decider may register its own schemas (``--no-auto-register`` turns it off)."""

    url: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    auto_register: bool = True

    def client(self) -> Any:
        """A new ``SchemaRegistryClient`` (``ConfigError`` on unknown settings)."""
        return registry_client(self.url, self.settings)

    def redact(self, text: str) -> str:
        """``text`` without this configuration's secrets."""
        return redact_registry_text(text, self.url, self.settings)

    def shown_url(self) -> str:
        """The URL as it may be logged (a password in it replaced)."""
        return self.redact(self.url)
