"""Secrets out of whatever rankmeter shows: log lines, error messages, report headers.

`redact` works on any text, so a URL or a client setting is caught wherever it ends up
(in an exception's message, in a library's log line, in a dict's repr). What counts as
a secret setting is one rule (`is_secret`), also used by the configuration, which never
coerces a secret's text (docs/security.md).
"""

from __future__ import annotations

import re

MASK = "***"

# Setting names whose values are secrets, in kafka-python's and librdkafka's spellings:
# sasl_plain_password, sasl.password, ssl_password, ssl.key.password, ssl.keystore.password,
# sasl.oauthbearer.client.secret, sasl.oauthbearer.config (may hold a client secret),
# ssl.key.pem, sasl_oauth_token_provider, Redis's password.
_SECRET = r"(?:password|passwd|secret|token|key[._]pem|oauthbearer[._]config)"
_SECRET_NAME = re.compile(_SECRET, re.IGNORECASE)

# scheme://user:password@host — the password is everything between the first `:` of the
# user info and the last `@` before the path, as urllib (and so redis-py) splits it.
_URL_PASSWORD = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:/?#@\s]*):[^/?#\s]*@")
# A secret setting's name, its quote if any, and `:` or `=`: 'ssl_password': '…',
# "password": "…" (also JSON-escaped, \"…\"), password=…, ?password=….
_NAME = rf"""([\w.-]*{_SECRET}[\w.-]*(\\?['"])?\s*[:=]\s*)"""
# A quoted value is masked whole, to its closing quote (commas, spaces, braces included).
_QUOTED_SETTING = re.compile(rf"""{_NAME}(\\?['"])(.*?)\3""", re.IGNORECASE | re.DOTALL)
# An unquoted one (or one whose closing quote is cut off) ends at a space, a comma (the
# `key=value,key=value` lists of the environment's settings) or `&` (a URL's query).
_BARE_SETTING = re.compile(rf"""{_NAME}(\\?['"])?(?!\*\*\*)[^\s,&'"\\]+""", re.IGNORECASE)
_PEM_KEY = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.DOTALL)


def is_secret(name: str) -> bool:
    """Whether a setting of this name holds a secret (masked, and kept as typed)."""
    return bool(_SECRET_NAME.search(name))


def redact(text: str) -> str:
    """`text` with URL passwords, secret settings and private keys replaced by ***; users are kept."""
    text = _URL_PASSWORD.sub(rf"\1:{MASK}@", text)
    text = _PEM_KEY.sub(MASK, text)
    text = _QUOTED_SETTING.sub(rf"\g<1>\g<3>{MASK}\g<3>", text)
    return _BARE_SETTING.sub(lambda m: f"{m[1]}{m[3] or ''}{MASK}", text)
