"""Settings from the environment: `RANKMETER_<SECTION>_<KEY>=value` read as the setting's
type (lists and maps split on commas, `kafka.client` values typed as the client's own)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from rankmeter.redaction import is_secret


def overrides(environ: Mapping[str, str], sections: Iterable[str]) -> dict[str, Any]:
    """RANKMETER_<SECTION>_<KEY>=value -> {section: {key: value}} (RANKMETER_CONFIG excluded)."""
    out: dict[str, Any] = {}
    section_names = sorted(sections, key=len, reverse=True)
    for var, value in environ.items():
        if not var.startswith("RANKMETER_") or var == "RANKMETER_CONFIG":
            continue
        rest = var[len("RANKMETER_"):].lower()
        if rest == "log_level":
            out["log_level"] = value
            continue
        for section in section_names:
            if rest.startswith(section + "_"):
                out.setdefault(section, {})[rest[len(section) + 1:]] = value
                break
    return out


def coerce(section: type[msgspec.Struct], key: str, value: str) -> Any:
    """Environment values are strings: split lists and maps; msgspec converts the rest."""
    hint = section.__annotations__.get(key, "")
    if hint.startswith("list["):
        return [item.strip() for item in value.split(",") if item.strip()]
    if hint.startswith("dict["):
        pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"{key}: expected key=value,key=value")
        if hint == "dict[str, Any]":  # kafka.client
            return {k.strip(): _client_value(k.strip(), v.strip()) for k, v in pairs}
        return {k.strip(): _scalar(v.strip()) for k, v in pairs}
    if hint == "bool":
        return value.strip().lower() in ("1", "true", "yes", "on")
    return value


def _client_value(key: str, text: str) -> Any:
    """A `kafka.client` value from the environment, typed as the setting is. Secrets and
    user names stay text (a password `0123` must not become 123), and so do librdkafka's
    dotted names (it parses its own strings); kafka-python's are typed as its defaults are
    (numbers, booleans, text), guessed only for those without a default."""
    if is_secret(key) or key.endswith("_username") or "." in key:
        return text
    from kafka import KafkaConsumer, KafkaProducer  # here: only environments with kafka.client pay for it
    default = KafkaConsumer.DEFAULT_CONFIG.get(key, KafkaProducer.DEFAULT_CONFIG.get(key))
    if isinstance(default, str):
        return text
    if isinstance(default, bool):
        return text.lower() in ("1", "true", "yes", "on")
    return _scalar(text)


def _scalar(text: str) -> Any:
    """`6000` -> 6000, `true` -> True: kafka-python wants typed client settings."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text
