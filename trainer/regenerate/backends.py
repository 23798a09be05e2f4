"""The engines that write the responses (`GenerationBackend`, `make_backend`): transformers, vLLM in
this process, OpenAI-compatible servers (trainer/server_client.py). Heavy only when built."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from trainer.regenerate.meta import BACKENDS, RegenerateError

# transformers' greedy decoding: no sampling, and the sampling values of the model's generation config
# (temperature, top_p, top_k) set to None for this call (they mean nothing without sampling)
GREEDY = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}


class GenerationBackend(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations (new tokens only) of a batch of tokenized prompts. A row may run
        past a stop token; the caller cuts it."""
        ...


class TransformersBackend:
    name = "transformers"

    def __init__(
        self, target_dir: Path, stop_ids: list[int], device: str = "auto", pad_id: int | None = None
    ):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from trainer.sources.hooked import resolve_dtype

        hf_logging.set_verbosity_error()
        dev = torch.device(
            "cuda"
            if device == "auto" and torch.cuda.is_available()
            else ("cpu" if device == "auto" else device)
        )
        self.device = dev
        self.model = (
            AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=resolve_dtype("auto", dev))
            .to(dev)
            .eval()
        )
        self.stop_ids = sorted(stop_ids)
        self.pad_id = pad_id if pad_id is not None else (self.stop_ids[0] if self.stop_ids else 0)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        import torch

        width = max(len(p) for p in prompts)
        inp = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        # An explicit stop rule: the stop ids given here, never the model's generation config alone.
        stop = {"eos_token_id": self.stop_ids} if self.stop_ids else {"min_new_tokens": max_new_tokens}
        with torch.no_grad():
            gen = self.model.generate(
                inp,
                attention_mask=att,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_id,
                **GREEDY,
                **stop,
            )
        return gen[:, width:].tolist()


class VLLMBackend:
    """vLLM's offline engine in this process (trainer/vllm_engine.py): continuous batching over the whole
    batch, greedy, token ids in and out; the caller's stop ids are the only stop rule, as in the
    transformers backend. Its output goes to `log` (trainer/vllm_engine.py), its death is one line, exit 1."""

    name = "vllm"

    def __init__(
        self,
        target_dir: Path,
        stop_ids: list[int],
        device: str = "auto",
        *,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        log: Path | None = None,
    ):
        from trainer import vllm_engine

        vllm = vllm_engine.import_vllm("--backend vllm", RegenerateError)
        self.version = f"vllm {vllm.__version__}"
        cpu = vllm_engine.on_cpu(device, RegenerateError)
        self.engine = vllm_engine.build_engine(
            vllm,
            target_dir,
            cpu=cpu,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            log=log,
            what=f"running {target_dir}",
        )
        self.stop_ids = sorted(stop_ids)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return self.engine.generate(prompts, max_new_tokens, self.stop_ids)


def make_backend(
    name: str,
    target_dir: Path,
    stop_ids: list[int],
    device: str = "auto",
    pad_id: int | None = None,
    *,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    servers: tuple[str, ...] = (),
    server_options: dict[str, Any] | None = None,
    engine_log: Path | None = None,
):
    if name == "transformers":
        return TransformersBackend(target_dir, stop_ids, device, pad_id)
    if name == "vllm":
        return VLLMBackend(
            target_dir,
            stop_ids,
            device,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            log=engine_log,
        )
    if name == "server":
        from trainer.server_client import ServerBackend

        return ServerBackend(list(servers), stop_ids, **(server_options or {}))
    raise RegenerateError(f"--backend {name!r}: choose one of {', '.join(BACKENDS)}")
