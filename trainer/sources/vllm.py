"""Hidden states streamed from a vLLM server that holds the target (`target.source: vllm`).

Each document of a packed batch is one completions request (its token ids as the prompt, one new
token); the server's hidden-state connector writes the rows of the kept layers to a safetensors file
and answers with its path (`kv_transfer_params.hidden_states_path`). The file is read once its writer
releases the companion `.lock` (a shared flock waits for that), checked (the token ids are the
request's, the shape is [tokens, layers, hidden], the layer ids the file records are the run's: a file
that records none is refused) and deleted; a file that cannot be read (the server's write failed) is
requested again, then refused naming its folder's free space. A batch's features are the documents'
rows concatenated, aux layers side by side as the hooked source gives them, the verifier's last state
(id num_layers) apart.

Streaming: `batches(sampler)` wraps the run's sampler so that each rank has `prefetch_batches` batches
requested ahead; the training step then only waits for what the server has not finished. The
checkpointed sampler position is that of the oldest batch not yet trained on, so a restart requests
again exactly what was in flight. The wait per step is reported (`hs_wait_s` in step events).

Before any training the server is checked: it serves this target (its model folder), its context fits
the run's longest document, and a probe request comes back with the run's layer ids and hidden size.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.layout.server_tap import REQUEST_THREADS, server_layer_ids
from trainer.sources.base import Captured
from trainer.sources.vllm_server import VllmServerError, VllmServerMismatch
from trainer.target.info import TargetInfo

Warn = Callable[[str, str], None]  # (kind, message)


def document_spans(position_ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each document of a packed sequence (positions restart at 0 per document)."""
    starts = np.flatnonzero(np.asarray(position_ids) == 0).tolist()
    if not starts or starts[0] != 0:
        raise ValueError("a packed sequence must start a document at position 0")
    ends = starts[1:] + [int(np.asarray(position_ids).size)]
    return list(zip(starts, ends))


def read_hidden_states(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A connector's file once its writer is done (shared flock on `<path>.lock`), and its metadata."""
    from safetensors import safe_open

    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps until the writer releases LOCK_EX
        with safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def remove_hidden_states(path: str) -> None:
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


class PrefetchingSampler:
    """The run's sampler with `depth` batches drawn and requested ahead (`submit(batch)` -> Future).
    `state_dict()` is where the oldest batch not yet handed out was drawn from: resuming there
    draws the in-flight batches again."""

    def __init__(self, sampler, depth: int, submit: Callable[[dict[str, Any]], Future]):
        self.sampler, self.depth, self.submit = sampler, depth, submit
        self._ahead: deque[tuple[dict[str, int], dict[str, Any]]] = deque()

    def _fill(self) -> None:
        while len(self._ahead) < self.depth:
            state = self.sampler.state_dict()
            b = self.sampler.next_batch()
            b["ticket"] = self.submit(b)
            self._ahead.append((state, b))

    def next_batch(self) -> dict[str, Any]:
        self._fill()
        _, b = self._ahead.popleft()
        self._fill()  # the next request goes out before this batch is trained on
        return b

    def state_dict(self) -> dict[str, int]:
        return dict(self._ahead[0][0]) if self._ahead else self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        for _, b in self._ahead:
            b["ticket"].cancel()
        self._ahead.clear()
        self.sampler.load_state_dict(state)


class VllmSource:
    """`HiddenStateSource` over a vLLM server at `url` (see the module docstring)."""

    embedding_weight = None  # the target lives in the server: the drafter keeps its own embedding
    server = None  # the OwnedServer this run started, stopped by close()

    def __init__(
        self,
        url: str,
        target_path: Path,
        aux_ids: list[int],
        *,
        out_device: torch.device | str = "cpu",
        longest_document: int = 0,
        prefetch_batches: int = 4,
        request_timeout_s: float = 300.0,
        retries: int = 5,
        warn: Warn | None = None,
        concurrency: int = REQUEST_THREADS,
    ):
        import httpx

        info = TargetInfo.from_folder(Path(target_path))
        self.url = url.rstrip("/").removesuffix("/v1")
        self.target_path = Path(target_path)
        self.aux_ids = list(aux_ids)
        self.num_layers, self.hidden_size = info.num_layers, info.hidden
        self.layer_ids = server_layer_ids(self.aux_ids, self.num_layers)
        self.out_device = torch.device(out_device)
        self.prefetch_batches = prefetch_batches
        self.retries = retries
        self.warn = warn or (lambda kind, message: None)
        self.client = httpx.Client(base_url=self.url, timeout=request_timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dflash-hs")
        self._lock = threading.Lock()
        self.wait_s = 0.0  # time capture() spent waiting for the server, since the last take_wait()
        self.bytes_read = 0
        self.tokens_read = 0
        self.model = self._check_model(longest_document)
        self._probe()

    # ------------------------------------------------------------------ checks before training
    def _get(self, path: str) -> dict[str, Any]:
        import httpx

        try:
            r = self.client.get(path)
            r.raise_for_status()
            return r.json()
        except httpx.HTTPError as exc:
            raise VllmServerError(f"target.vllm.url {self.url}: no vLLM server answers ({exc})") from None

    def _check_model(self, longest_document: int) -> str:
        models = self._get("/v1/models").get("data") or []
        if not models:
            raise VllmServerMismatch(f"target.vllm.url {self.url}: the server serves no model")
        card = models[0]
        served = Path(str(card.get("root") or card.get("id")))
        if not _same_model(served, self.target_path):
            raise VllmServerMismatch(
                f"target.vllm.url {self.url} serves {served}, not this run's target {self.target_path} "
                "(their config.json differ): start it on the run's target"
            )
        limit = card.get("max_model_len")
        if limit is not None and longest_document + 1 > int(limit):
            raise VllmServerMismatch(
                f"target.vllm.url {self.url}: its max_model_len {limit} is shorter than the run's longest "
                f"document ({longest_document} tokens) + 1: restart it with --max-model-len "
                f"{longest_document + 1} or more"
            )
        return str(card["id"])

    def _probe(self) -> None:
        """One tiny request: the server really extracts this run's layers (not only serves the model)."""
        ids = [1, 2, 3, 4]
        self._request(ids)  # raises on a mismatch

    # ------------------------------------------------------------------ requests
    def _post(self, ids: list[int]) -> str:
        """One document's request, retried with backoff; the path of its hidden-state file."""
        import httpx

        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        for attempt in range(self.retries + 1):
            try:
                r = self.client.post("/v1/completions", json=body)
                if r.status_code < 500:
                    r.raise_for_status()
                    params = r.json().get("kv_transfer_params") or {}
                    path = params.get("hidden_states_path")
                    if not path:
                        raise VllmServerMismatch(
                            f"target.vllm.url {self.url}: the answer names no hidden-state file: the "
                            "server was not started for hidden-state extraction (extract_hidden_states "
                            "and a hidden-state kv connector; see `dflash serve-target --print-command`)"
                        )
                    return str(path)
                problem = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPStatusError as exc:
                raise VllmServerError(f"target.vllm.url {self.url}: request refused ({exc})") from None
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt == self.retries:
                raise VllmServerError(
                    f"target.vllm.url {self.url}: hidden-state request failed {self.retries + 1} times "
                    f"(last: {problem})"
                )
            delay = min(30.0, 2.0**attempt)
            self.warn(
                "hidden_state_server",
                f"hidden-state request failed ({problem}); retry {attempt + 1}/{self.retries} in {delay:g} s",
            )
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _read(self, ids: list[int]) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
        """One document's file (path, tensors, metadata), deleted once read. A file that cannot be read
        (the server's write failed: a full /dev/shm; vLLM's own connector only logs that) is requested
        again with the request's backoff, then refused naming the folder's free space and the fix."""
        from safetensors import SafetensorError

        for attempt in range(self.retries + 1):
            path = self._post(ids)
            try:
                tensors, meta = read_hidden_states(path)
                return path, tensors, meta
            except (OSError, SafetensorError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            finally:
                remove_hidden_states(path)
            if attempt < self.retries:
                delay = min(30.0, 2.0**attempt)
                self.warn(
                    "hidden_state_server",
                    f"{path}: the hidden-state file cannot be read ({problem}); request {attempt + 1}/"
                    f"{self.retries} again in {delay:g} s",
                )
                time.sleep(delay)
        raise VllmServerError(unreadable(path, problem, self.retries + 1))

    def _request(self, ids: list[int]) -> torch.Tensor:
        """[T, len(layer_ids), H] for one document, checked, its file deleted."""
        path, tensors, meta = self._read(ids)
        hs, got_ids = tensors.get("hidden_states"), tensors.get("token_ids")
        if hs is None or got_ids is None:
            raise VllmServerError(f"{path}: not a hidden-state file (keys {sorted(tensors)})")
        if "layer_ids" not in meta:
            raise VllmServerMismatch(
                f"target.vllm.url {self.url}: its hidden-state files do not say which layers they hold "
                "(vLLM's own ExampleHiddenStatesConnector records none), so this run cannot check them: "
                "start the server with `dflash serve-target` (kv_connector HiddenStatesConnector from "
                "trainer.sources.vllm_connector)"
            )
        if json.loads(meta["layer_ids"]) != self.layer_ids:
            raise VllmServerMismatch(
                f"target.vllm.url {self.url} extracts layers {json.loads(meta['layer_ids'])}, this run needs "
                f"{self.layer_ids} (drafter aux ids + the verifier's last state): restart it with the run's "
                "layer ids"
            )
        want = (len(ids), len(self.layer_ids), self.hidden_size)
        if tuple(hs.shape) != want:
            raise VllmServerMismatch(
                f"target.vllm.url {self.url}: hidden states of shape {tuple(hs.shape)}, expected {want} "
                "(tokens, layers, hidden): the server taps other layers or serves another model"
            )
        if got_ids.tolist() != list(ids):
            raise VllmServerError(f"{path}: the file holds other tokens than its request (a stale file?)")
        with self._lock:
            self.bytes_read += hs.numel() * hs.element_size()
            self.tokens_read += hs.shape[0]
        return hs

    def _features(self, input_ids: np.ndarray, position_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [1, T, n_aux*H], last [1, T, H]) on the CPU, the documents requested in parallel."""
        ids = np.asarray(input_ids).reshape(-1)
        spans = document_spans(np.asarray(position_ids).reshape(-1))
        futures = [self.pool.submit(self._request, ids[a:b].tolist()) for a, b in spans]
        rows = torch.cat([f.result() for f in futures], dim=0)  # [T, layers, H]
        pick = [self.layer_ids.index(k) for k in self.aux_ids]
        aux = rows[:, pick].reshape(1, rows.shape[0], -1)
        last = rows[:, self.layer_ids.index(self.num_layers)].unsqueeze(0)
        return aux, last

    def submit(self, batch: dict[str, Any]) -> Future:
        """Request a sampler batch's features now (read later by capture(..., ticket=))."""
        return self.pool.submit(self._features, batch["input_ids"], batch["position_ids"])

    def batches(self, sampler) -> PrefetchingSampler:
        return PrefetchingSampler(sampler, self.prefetch_batches, self.submit)

    def capture(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, ticket: Future | None = None
    ) -> Captured:
        t0 = time.perf_counter()
        if ticket is None:
            aux, last = self._features(input_ids.cpu().numpy(), position_ids.cpu().numpy())
        else:
            aux, last = ticket.result()
        self.wait_s += time.perf_counter() - t0
        return Captured(aux=aux.to(self.out_device), last=last.to(self.out_device))

    def take_counters(self) -> tuple[float, int, int]:
        """(seconds capture() waited, bytes and tokens of hidden states read) since the last call."""
        with self._lock:
            out = self.wait_s, self.bytes_read, self.tokens_read
            self.wait_s, self.bytes_read, self.tokens_read = 0.0, 0, 0
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        if self.server is not None:
            self.server.stop()
            self.server = None


def unreadable(path: str, problem: str, tries: int) -> str:
    """Why a hidden-state file could not be read `tries` times, with its folder's free space and the fix."""
    import shutil

    folder = os.path.dirname(path) or "."
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free"
    except OSError:
        free = "its free space unknown"
    return (
        f"{path}: the vLLM server's hidden-state file could not be read after {tries} requests (last: "
        f"{problem}); its folder {folder} has {free}: the server's write failed there (its log says "
        "'Hidden-states write failed') or it died. Give the folder room: a larger /dev/shm (docker/podman "
        "run --shm-size=2g, or --ipc=host) or target.vllm.storage_dir on a disk; see vllm-server.log"
    )


def _same_model(served: Path, target: Path) -> bool:
    """The server's model folder is the run's target: the same folder, or one with the same config.json."""
    try:
        if served.resolve() == target.resolve():
            return True
        theirs = json.loads((served / "config.json").read_text())
        return theirs == json.loads((target / "config.json").read_text())
    except (OSError, ValueError):
        return False


def open_vllm_source(cfg, device: torch.device, *, d=None, warn: Warn | None = None) -> VllmSource:
    """The run's VllmSource: on target.vllm.url, or on a server the main rank starts now (its URL
    handed to the other ranks); the owned server stops with the source."""
    from trainer.layout.server_tap import longest_document
    from trainer.sources.vllm_server import start_owned_server

    v = cfg.target.vllm
    url, server = v.url, None
    main = d is None or d.is_main
    if url is None:
        if main:
            server = start_owned_server(
                cfg, log=(lambda m: warn("hidden_state_server", m)) if warn else print
            )
            url = server.url
        if d is not None and d.enabled:
            import torch.distributed as dist

            from trainer.training.distributed import end_startup

            box = [url]
            dist.broadcast_object_list(box, src=0)  # the start-up's bound (startup_timeout_s)
            url = box[0]
            end_startup(cfg, d)
    try:
        source = VllmSource(
            url,
            cfg.target.path,
            cfg.drafter.aux_ids,
            out_device=device,
            longest_document=longest_document(cfg),
            prefetch_batches=v.prefetch_batches,
            request_timeout_s=v.request_timeout_s,
            retries=v.retries,
            warn=warn,
        )
    except BaseException:
        if server is not None:
            server.stop()
        raise
    source.server = server
    return source
