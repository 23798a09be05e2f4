"""The one home for keeping secrets out of what the package writes or serves: secret-looking keys in
events, token-looking strings in log lines. Light side."""

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
TOKEN_SHAPES = re.compile(
    r"(?:AKIA|ASIA)[0-9A-Z]{16}"  # AWS access key ids (ASIA: temporary, from STS)
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face token
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub tokens
    r"|sk-[A-Za-z0-9_-]{20,}"  # API keys of the OpenAI kind
)
SECRET_NAME = r"(?:secret|token|password|passwd|passphrase|api_key|apikey|access_key|secret_key|private_key)"
# each match keeps its group `a` (what names the secret) and masks its group `s` (the secret)
SECRET_RULES = (
    # https://user:pass@host: the password of a URL's user info
    re.compile(r"(?i)\b(?P<a>[a-z][a-z0-9+.-]*://[^/\s:@]+:)(?P<s>[^/\s@]+)(?=@)"),
    # --token X, --hf-token=X, --password X, --secret-access-key X (not --max-new-tokens 5)
    re.compile(
        r"(?i)(?P<a>--(?:[a-z0-9]+-)*(?:token|password|passwd|passphrase|secret|api-key|apikey|access-key)"
        r"(?:-[a-z0-9]+)*(?:=|\s+))(?P<s>[^\s\"']+)"
    ),
    # Authorization: Basic abc=, Authorization: Bearer x, "authorization": "token x"
    re.compile(
        r"(?i)(?P<a>authorization[\"']?\s*[=:]\s*[\"']?(?:(?:basic|bearer|digest|token)\s+)?)"
        r"(?P<s>[^\s,;\"']+)"
    ),
    re.compile(r"(?i)(?P<a>\bbearer\s+)(?P<s>[A-Za-z0-9._~+/=-]{8,})"),
    # password=x, token: x, "secret": "x y", 'hf_token': 'x' (JSON, YAML, env, Python reprs)
    re.compile(
        r"(?i)(?P<a>" + SECRET_NAME + r"[\"']?\s*[=:]\s*)"
        r"(?P<s>\"(?:[^\"\\]|\\.)*\"|'[^']*'|[^\s,;\"'}\]]+)"
    ),
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


# Every secret rule's match contains one of these (lower-cased): a plain substring test first keeps the
# regexes off the ordinary log line, so serving a long log tail stays cheap.
TRIGGERS = (
    "akia",
    "asia",
    "hf_",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "sk-",
    "bearer",
    "authorization",
    "secret",
    "token",
    "passw",
    "passphrase",
    "api_key",
    "apikey",
    "api-key",
    "access_key",
    "access-key",
    "private_key",
    "://",
)


def _mask(m: re.Match) -> str:
    secret = m.group("s")
    quote = secret[0] if secret[:1] in ("'", '"') and len(secret) > 1 and secret[-1] == secret[0] else ""
    return m.group("a") + quote + MASK + quote


def redact_text(text: str) -> str:
    low = text.lower()
    if not any(t in low for t in TRIGGERS):
        return text
    for rule in SECRET_RULES:
        text = rule.sub(_mask, text)
    return TOKEN_SHAPES.sub(MASK, text)
