"""Keep secrets out of what the monitor serves: secret-looking keys in events, token-looking strings in
log lines. Light side."""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
SECRET_WORDS = {
    "secret",
    "token",
    "password",
    "passwd",
    "passphrase",
    "credential",
    "credentials",
    "apikey",
    "auth",
    "authorization",
    "cookie",
    "signature",
}
SECRET_PAIRS = ("api_key", "access_key", "private_key", "secret_key", "session_key")
SECRET_TEXT = re.compile(
    r"(AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face token
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub tokens
    r"|sk-[A-Za-z0-9_-]{20,}"  # API keys of the OpenAI kind
    r"|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}"
    r"|(?i:(?:secret|token|password|passwd|api_key|access_key)[\"']?\s*[=:]\s*)[^\s,;\"']+)"
)


def redact(value: Any) -> Any:
    """A copy of an event with the values of secret-looking keys masked (recursively)."""
    if isinstance(value, dict):
        return {
            k: (
                MASK
                if secret_key(k) and v not in (None, "") and not isinstance(v, (dict, list))
                else redact(v)
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def secret_key(key: Any) -> bool:
    """`hf_token`, `aws_secret_access_key`, `password` are; `tokens`, `max_tokens_per_batch` are not."""
    if not isinstance(key, str):
        return False
    low = key.lower().replace("-", "_")
    return bool(SECRET_WORDS & set(re.split(r"[^a-z0-9]+", low))) or any(p in low for p in SECRET_PAIRS)


# Every SECRET_TEXT match contains one of these (lower-cased): a plain substring test first keeps the
# regex off the ordinary log line, so serving a long log tail stays cheap.
TRIGGERS = (
    "akia",
    "hf_",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "sk-",
    "bearer",
    "secret",
    "token",
    "passw",
    "api_key",
    "access_key",
)


def redact_text(text: str) -> str:
    low = text.lower()
    if not any(t in low for t in TRIGGERS) or not SECRET_TEXT.search(text):
        return text

    def mask(m: re.Match) -> str:
        s = m.group(0)
        for sep in ("=", ":"):
            if sep in s and not s.lower().startswith("bearer"):
                return s[: s.index(sep) + 1] + MASK
        return MASK

    return SECRET_TEXT.sub(mask, text)
