"""Secrets out of whatever rankmeter shows: log lines, error messages, report headers.

`redact` works on any text, so a URL or a client setting is caught wherever it ends up
(in an exception's message, in a library's log line, in a dict's repr).
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user:password@host — the password is everything between the first `:` of the
# user info and the last `@` before the path, as urllib (and so redis-py) splits it.
_URL_PASSWORD = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:/?#@\s]*):[^/?#\s]*@")
# password=…, ?password=…, sasl_plain_password=…, 'ssl_password': '…', "password": "…"
_PASSWORD_SETTING = re.compile(r"""(password\\?['"]?\s*[:=]\s*\\?['"]?)[^'"\\,&}\s]+""", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with URL passwords and `*password*` settings replaced by ***; users are kept."""
    text = _URL_PASSWORD.sub(rf"\1:{MASK}@", text)
    return _PASSWORD_SETTING.sub(rf"\g<1>{MASK}", text)
