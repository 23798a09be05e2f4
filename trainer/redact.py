"""The one home for keeping secrets out of what the package writes, serves or prints. Light side.

Every sink goes through here: the event writer and train.log (trainer/store/events.py), every monitor view and
`dflash status` / `summary` (trainer/monitor), the salvage inventory, NOTES.md and reports
(trainer/salvage), and the CLI's error line (trainer/cli). Three entry points:

- `redact(value)`: a JSON-like value (an event, a snapshot) with the whole value of every secret-looking
  key masked (a string, a number, a list or a mapping alike), and every string in it through
  `redact_text`;
- `redact_text(text)`: a free-form line (a log line, an error message, a command line) with the secrets
  it spells masked: a URL's password, `--token X`, `password=x`, `"apiKey": "x"` (also as escaped JSON
  inside a string), `Authorization:` / `Cookie:` / `X-Api-Key:` headers, a presigned URL's
  `X-Amz-Signature`, and token-shaped strings (AWS key ids, Hugging Face / GitHub / OpenAI-style keys,
  JWTs, PEM private keys);
- `redact_argv(argv)`: another process's command line, one argument at a time (the value after a secret
  flag is masked whole, spaces and all).

An ordinary line costs one lower-casing and a few substring tests (`TRIGGERS`): the regexes run only on
a line that holds one of them. Every quantifier a search can restart on is bounded, so a long line costs
time in proportion to its length; callers that read untrusted files still cap the line first (the
monitor's log tail: trainer/monitor/tailer.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

MASK = "***"

# ------------------------------------------------------------------ keys of mappings
# a word of a key (split at `_`, `-`, `.`, camelCase) that makes it secret, or a word ending in one
SECRET_WORDS = frozenset(
    (
        "secret",
        "secrets",
        "token",
        "password",
        "passwords",
        "passwd",
        "passphrase",
        "credential",
        "credentials",
        "apikey",
        "auth",
        "authorization",
        "cookie",
        "cookies",
        "signature",
    )
)
SECRET_ENDINGS = ("token", "secret", "password", "passwd", "passphrase", "apikey", "cookie", "signature")
# two words that name a secret together (`access_key`, not `access` or `key` alone); they win over
# DESCRIPTORS (`aws_access_key_id` is masked)
SECRET_PAIRS = ("apikey", "accesskey", "privatekey", "secretkey", "sessionkey", "clientsecret")
# a word that makes a key describe tokens rather than hold one: `max_tokens_per_batch` has no secret
# word at all, `mask_token_id`, `stop_token_ids`, `token_progress`, `pad_token`, `token_file` have one
DESCRIPTORS = frozenset(
    (
        "id",
        "ids",
        "count",
        "counts",
        "num",
        "max",
        "min",
        "per",
        "progress",
        "budget",
        "limit",
        "len",
        "length",
        "size",
        "total",
        "rate",
        "mask",
        "eos",
        "bos",
        "pad",
        "unk",
        "sep",
        "cls",
        "stop",
        "special",
        "anchor",
        "reference",
        "speculative",
        "verifier",
        "draft",
        "target",
        "prompt",
        "response",
        "prompts",
        "problems",
        "vocab",
        "file",
        "path",
        "type",
        "kind",
        "kv",
    )
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")


def secret_key(key: Any) -> bool:
    """`hf_token`, `aws_secret_access_key`, `SecretAccessKey`, `apiKey`, `password` are;
    `tokens`, `max_tokens_per_batch`, `mask_token_id`, `token_progress` are not."""
    return isinstance(key, str) and len(key) <= 200 and _secret_key(key)


@lru_cache(maxsize=4096)  # an event's keys repeat: each is judged once
def _secret_key(key: str) -> bool:
    words = [w for w in _WORD_SPLIT.split(_CAMEL.sub("_", key).lower()) if w]
    squashed = "".join(words)
    if any(p in squashed for p in SECRET_PAIRS):
        return True
    if DESCRIPTORS.intersection(words):
        return False
    return any(w in SECRET_WORDS or w.endswith(SECRET_ENDINGS) for w in words)


def redact(value: Any) -> Any:
    """A copy of a JSON-like value with the whole value of every secret-looking key masked (a list or a
    mapping too) and every string through `redact_text`. None and "" stay (nothing to hide)."""
    if isinstance(value, dict):
        return {
            k: (MASK if secret_key(k) and v is not None and v != "" else redact(v)) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


# ------------------------------------------------------------------ free text
TOKEN_SHAPES = re.compile(
    r"(?:AKIA|ASIA)[0-9A-Z]{16}"  # AWS access key ids (ASIA: temporary, from STS)
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face token
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub tokens
    r"|sk-[A-Za-z0-9_-]{20,}"  # API keys of the OpenAI kind
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"  # a JWT
    r"|-----BEGIN [A-Z ]{0,20}PRIVATE KEY-----[\s\S]{0,10000}?-----END [A-Z ]{0,20}PRIVATE KEY-----"
)
# what names a secret as a key in text (`password=`, `"hf_token":`, `SecretAccessKey`, `X-Api-Key:`,
# `X-Amz-Signature=`, `sig=` of a SAS URL); the name must end there: `max_tokens: 5`, `mask_token_id=3`
# do not match
SECRET_NAME = (
    r"(?:secret|token|password|passwd|passphrase|credentials?|signature|(?<![a-z])sig(?==)|(?<![a-z])auth"
    r"|api[_-]?key|access[_-]?key|secret[_-]?key|private[_-]?key|session[_-]?key)"
)
# a value: "quoted", \"escaped-quoted\" (JSON inside a JSON string), 'quoted', [a list], {a mapping},
# or a bare word up to a separator (`&` ends a query parameter)
VALUE = (
    r"(?P<s>\\\"(?:(?!\\\")[^\n]){0,4096}\\\"|\"(?:[^\"\\\n]|\\.){0,4096}\"|'[^'\n]{0,4096}'"
    r"|\[[^\[\]\n]{0,4096}\]|\{[^{}\n]{0,4096}\}|[^\s,;\"'}\]&]+)"
)
# a flag naming a secret (`--hf-token`, `--api_key`); `_mask` then asks `secret_key` of its name, so
# `--stop-token-ids 2` and `--token-file F` keep their value
SECRET_FLAG = (
    r"--(?P<f>(?:[a-z0-9]{1,40}[-_]){0,8}(?:token|password|passwd|passphrase|secret|credentials?|auth"
    r"|cookie|api[-_]?key|apikey|access[-_]?key|private[-_]?key|secret[-_]?key)(?:[-_][a-z0-9]{1,40}){0,8})"
)
_FLAG_ONLY = re.compile(r"(?i)" + SECRET_FLAG)
# what the last rule needs in a lower-cased line before it is worth running (its own search is the slow one)
_NAME_GATE = re.compile(SECRET_NAME + r"(?:\\?[\"'])?\s*[=:]")
# (gate, rule): a rule runs only on a line whose lower-cased text passes its gate (a cheap test that
# every match of the rule passes); each match keeps its group `a` (what names the secret) and masks its
# group `s` (the secret)
SECRET_RULES: tuple[tuple[Callable[[str], Any], re.Pattern[str]], ...] = (
    # scheme://user:password@host, scheme://:password@host (no user), a `/` in the password
    (
        (lambda low: "://" in low and "@" in low),
        re.compile(r"(?i)(?P<a>\b[a-z][a-z0-9+.-]{0,30}://[^/\s:@\"]{0,256}:)(?P<s>[^\s@\"]{1,256})(?=@)"),
    ),
    # --token X, --hf-token=X, --hf_token X, --password "a b", --api-key K (not --max-new-tokens 5)
    (
        (lambda low: "--" in low),
        re.compile(
            r"(?i)(?P<a>" + SECRET_FLAG + r"(?:=|\s+))"
            r"(?P<s>\"(?:[^\"\\\n]|\\.){0,4096}\"|'[^'\n]{0,4096}'|(?!--)[^\s\"']+)"
        ),
    ),
    # Cookie: a=b; c=d (the whole header), "cookie": "..."
    (
        (lambda low: "cookie" in low),
        re.compile(
            r"(?i)(?P<a>\b(?:set-)?cookie\\?[\"']?\s*[=:]\s*)"
            r"(?P<s>\\\"(?:(?!\\\")[^\n]){0,4096}\\\"|\"(?:[^\"\\\n]|\\.){0,4096}\"|'[^'\n]{0,4096}'|[^\n\"']+)"
        ),
    ),
    # Authorization: Basic abc=, Proxy-Authorization: Bearer x, "authorization": "token x"
    (
        (lambda low: "authorization" in low),
        re.compile(
            r"(?i)(?P<a>authorization\\?[\"']?\s*[=:]\s*\\?[\"']?(?:(?:basic|bearer|digest|token)\s+)?)"
            r"(?P<s>[^\s,;\"'\\]+)"
        ),
    ),
    ((lambda low: "bearer" in low), re.compile(r"(?i)(?P<a>\bbearer\s+)(?P<s>[A-Za-z0-9._~+/=-]{8,})")),
    # password=x, token: x, "secret": "x y", 'hf_token': 'x', {\"token\": \"x\"}, "apiKey": [..],
    # X-Api-Key: K, X-Amz-Signature=abc&... (JSON, YAML, env, Python reprs, headers, query strings)
    (_NAME_GATE.search, re.compile(r"(?i)(?P<a>" + SECRET_NAME + r"(?:\\?[\"'])?\s*[=:]\s*)" + VALUE)),
)


SHAPE_TRIGGERS = ("akia", "asia", "hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "sk-", "eyj", "private key")
# Every rule's match contains one of these (lower-cased): a plain substring test first keeps the regexes
# off the ordinary line, so serving a long log tail stays cheap.
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
    "eyj",
    "private key",
    "bearer",
    "auth",
    "cookie",
    "secret",
    "token",
    "passw",
    "passphrase",
    "credential",
    "signature",
    "sig=",
    "api_key",
    "apikey",
    "api-key",
    "access_key",
    "access-key",
    "accesskey",
    "private_key",
    "private-key",
    "privatekey",
    "session_key",
    "session-key",
    "sessionkey",
    "://",
)


def _mask(m: re.Match) -> str:
    flag = m.groupdict().get("f")
    if flag is not None and not secret_key(flag):
        return m.group(0)
    secret = m.group("s")
    for quote in ('\\"', '"', "'"):
        if len(secret) >= 2 * len(quote) and secret.startswith(quote) and secret.endswith(quote):
            return m.group("a") + quote + MASK + quote
    return m.group("a") + MASK


def redact_text(text: str) -> str:
    """`text` with every secret it spells masked (see the module's docstring); unchanged (the same
    object) when it holds none of the `TRIGGERS`."""
    low = text.lower()
    if not any(t in low for t in TRIGGERS):
        return text
    for gate, rule in SECRET_RULES:
        if gate(low):  # masking only takes text away: a gate passed by the original line is enough
            text = rule.sub(_mask, text)
    if any(t in low for t in SHAPE_TRIGGERS):
        text = TOKEN_SHAPES.sub(MASK, text)
    return text


def redact_argv(argv: list[str]) -> list[str]:
    """A command line's arguments with the secrets masked: the argument after a secret flag
    (`--api-key K`, `--hf-token 'a b'`) whole, and every argument through `redact_text`."""
    out: list[str] = []
    after_flag = False
    for arg in argv:
        if after_flag and not arg.startswith("--"):
            out.append(MASK)
            after_flag = False
            continue
        flag = _FLAG_ONLY.fullmatch(arg)
        after_flag = flag is not None and secret_key(flag.group("f"))
        out.append(redact_text(arg))
    return out


def redact_cmdline(argv: list[str]) -> str:
    """The command line as one string (arguments joined by spaces), secrets masked."""
    return " ".join(redact_argv(argv))


_USERINFO = re.compile(r"(?i)^(?P<a>[a-z][a-z0-9+.-]{0,30}://)(?:[^/\s:@]*:[^\s@]*|[^/\s:@]+)@")


def redact_url(url: str) -> str:
    """A URL without its user and password (`https://***@host:5000/x`), and with secret query
    parameters masked: what a message may say about a tracking URI or a server."""
    return redact_text(_USERINFO.sub(lambda m: m.group("a") + MASK + "@", url, count=1))
