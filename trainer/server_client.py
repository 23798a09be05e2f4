"""Regeneration against an already running OpenAI-compatible engine (`dflash regenerate --server URL`):
token-id prompts to its completions endpoint, greedy, the new tokens back as ids.

The openai client does the HTTP, the per-request timeout and the retries with exponential backoff
(connection errors, 408/429/5xx); a thread pool bounds the requests in flight. Token ids in and out
need vLLM's extensions of the completions API (`return_token_ids`, `stop_token_ids`, `ignore_eos`):
`vllm serve` has them; a server without `return_token_ids` is refused on the first answer, not
silently re-tokenized.

Several URLs (one engine per GPU, data parallel): the prompts of a batch are dealt round robin over
them, `concurrency` requests in flight per engine; every engine must serve the same model.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainer.errors import DflashError
from trainer.redact import redact_url


class ServerError(DflashError, RuntimeError):
    """The server cannot be used; the message says why."""


class _Engine:
    """One server: its client, the model it serves and its length limit."""

    def __init__(self, openai, url: str, timeout_s: float, retries: int, wait_s: float = 0.0):
        self.url = url.rstrip("/")
        url = self.shown = redact_url(self.url)  # what messages, meta.json and events say: no password
        base = self.url if self.url.endswith("/v1") else self.url + "/v1"
        try:
            self.client = openai.OpenAI(
                base_url=base, api_key="EMPTY", timeout=timeout_s, max_retries=retries
            )
        except Exception as exc:  # noqa: BLE001  # httpx's InvalidURL: its text can quote part of a password
            raise ServerError(
                f"--server {url}: not a URL the client can use ({type(exc).__name__}; percent-encode "
                "any / : @ in a user name or password)"
            ) from None
        deadline = time.monotonic() + wait_s
        while True:  # an engine still loading its weights answers nothing yet: wait up to wait_s
            try:
                models = self.client.models.list().data
                break
            except openai.APIError as exc:
                if time.monotonic() >= deadline:
                    waited = f" within --server-wait {wait_s:g} s" if wait_s else ""
                    raise ServerError(
                        f"--server {url}: no OpenAI-compatible server answers there{waited} ({exc})"
                    ) from None
                time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
        if not models:
            raise ServerError(f"--server {url}: the server serves no model")
        self.model = models[0].id
        self.owner = models[0].owned_by
        self.max_model_len = (models[0].model_extra or {}).get("max_model_len")


class ServerBackend:
    name = "server"

    def __init__(
        self,
        urls: list[str] | str,
        stop_ids: list[int],
        *,
        concurrency: int = 16,
        timeout_s: float = 600.0,
        retries: int = 4,
        wait_s: float = 0.0,
    ):
        try:
            import openai
        except ImportError as exc:  # a runtime requirement (requirements/runtime.txt)
            raise ServerError(f"--server: the openai client is not installed ({exc})") from None
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls or len(set(u.rstrip("/") for u in urls)) != len(urls):
            shown = ", ".join(map(redact_url, urls)) or "none given"
            raise ServerError(f"--server: give each engine's URL once ({shown})")
        self.engines = [_Engine(openai, u, timeout_s, retries, wait_s) for u in urls]
        models = {e.model for e in self.engines}
        if len(models) > 1:
            raise ServerError(
                "--server: the engines serve different models ("
                + ", ".join(f"{e.shown}: {e.model}" for e in self.engines)
                + "): one regeneration needs one target"
            )
        self.stop_ids = sorted(stop_ids)
        self.concurrency = concurrency
        self.model = self.engines[0].model
        limits = [e.max_model_len for e in self.engines if e.max_model_len]
        self.max_model_len = min(limits) if limits else None
        self.url = ", ".join(e.shown for e in self.engines)
        self.version = f"server {self.url} ({self.model}, {self.engines[0].owner})"

    def _one(self, engine: _Engine, prompt: list[int], max_new_tokens: int) -> list[int]:
        if self.max_model_len and len(prompt) + max_new_tokens > self.max_model_len:
            raise ServerError(
                f"a prompt of {len(prompt)} tokens + --max-new-tokens {max_new_tokens} exceeds the server's "
                f"max_model_len {self.max_model_len}: restart it with a larger one, or shorten the prompts"
            )
        resp = engine.client.completions.create(
            model=self.model,
            prompt=list(prompt),
            max_tokens=max_new_tokens,
            temperature=0.0,
            extra_body={
                "return_token_ids": True,
                "stop_token_ids": self.stop_ids or None,
                "ignore_eos": True,  # the model's EOS is not a stop unless it is one of stop_ids
                "skip_special_tokens": False,
            },
        )
        choice = resp.choices[0]
        extra: dict[str, Any] = choice.model_extra or {}
        ids = extra.get("token_ids")
        if ids is None:
            raise ServerError(
                f"--server {engine.shown}: the answer carries no token ids (the server does not support "
                "return_token_ids; vllm serve does)"
            )
        seen = extra.get("prompt_token_ids")
        if seen is not None and list(seen) != list(prompt):
            raise ServerError(f"--server {engine.shown}: the server read other prompt tokens than were sent")
        return list(ids)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        n = len(self.engines)
        workers = min(self.concurrency * n, len(prompts))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(
                pool.map(
                    lambda ip: self._one(self.engines[ip[0] % n], ip[1], max_new_tokens), enumerate(prompts)
                )
            )
