"""`RegenOptions` (what `dflash regenerate` is asked) and the argument checks done before any work."""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from urllib.parse import urlsplit

from trainer.regenerate.meta import BACKENDS, RegenerateError


@dataclass
class RegenOptions:
    target: Path
    prompts: Path
    out: Path
    max_new_tokens: int = 256
    batch_size: int = 16
    chat_template: bool | None = None
    thinking: str | None = None
    limit: int | None = None
    backend: str = "transformers"
    device: str = "auto"
    ignore_eos: bool = False
    dtype: str = "auto"  # the vLLM backend's (auto: the model's; float32 for token-exact CPU checks)
    tensor_parallel_size: int | None = None  # the vLLM backend's (None: planned, trainer/layout/inference.py)
    servers: tuple[str, ...] = ()  # the server backend's URLs (OpenAI-compatible engines already running)
    concurrency: int = 16  # the server backend's requests in flight, per server
    request_timeout_s: float = 600.0  # the server backend's, per request
    retries: int = 4  # the server backend's, per request (exponential backoff)
    server_wait_s: float = 0.0  # the server backend's: how long to wait for engines still loading
    max_empty_share: float = 0.02  # more empty responses than this share refuses the run
    run_dir: Path | None = None  # where the event stream goes (monitor page, dflash status)
    push_to: str | None = None  # s3://bucket/prefix: batches and the dataset are pushed there
    endpoint_url: str | None = None  # the S3 endpoint (radosgw, MinIO); None: AWS
    push_every_s: float = 60.0  # at most one push of the finished batches per this many seconds


def check_options(opts: RegenOptions) -> None:
    """Every argument error, before the tokenizer, the model or the engine is touched."""
    if opts.max_new_tokens < 1 or opts.batch_size < 1:
        raise RegenerateError("--max-new-tokens and --batch-size must be at least 1")
    if opts.backend not in BACKENDS:
        raise RegenerateError(f"--backend {opts.backend!r}: choose one of {', '.join(BACKENDS)}")
    if opts.backend != "vllm" and (opts.tensor_parallel_size is not None or opts.dtype != "auto"):
        raise RegenerateError("--tensor-parallel-size and --dtype are settings of --backend vllm")
    if bool(opts.servers) != (opts.backend == "server"):
        raise RegenerateError(
            "--server URL is a backend of its own (the engine is already running there): drop --backend"
            if opts.servers
            else "the server backend needs --server URL"
        )
    if opts.backend != "server" and (
        opts.concurrency != 16 or opts.request_timeout_s != 600 or opts.retries != 4 or opts.server_wait_s
    ):
        raise RegenerateError(
            "--concurrency, --request-timeout, --retries and --server-wait are settings of --server"
        )
    if opts.concurrency < 1 or opts.request_timeout_s <= 0 or opts.retries < 0 or opts.server_wait_s < 0:
        raise RegenerateError(
            "--concurrency must be >= 1, --request-timeout > 0, --retries and --server-wait >= 0"
        )
    if (opts.tensor_parallel_size or 1) < 1:
        raise RegenerateError(f"--tensor-parallel-size {opts.tensor_parallel_size}: must be at least 1")
    if not 0.0 <= opts.max_empty_share <= 1.0:
        raise RegenerateError(f"--max-empty-share {opts.max_empty_share}: a share between 0 and 1")
    if opts.push_to is not None:
        from trainer.s3 import S3Error
        from trainer.s3.client import parse_s3_url

        try:
            parse_s3_url(opts.push_to)
        except S3Error as exc:
            raise RegenerateError(str(exc).replace("--s3", "--push-to", 1)) from None
    elif opts.endpoint_url is not None:
        raise RegenerateError("--endpoint-url is a setting of --push-to")
    if not (Path(opts.target) / "config.json").is_file():
        raise RegenerateError(
            f"--target {opts.target}: no config.json (a transformers model folder is needed)"
        )
    if opts.backend == "vllm":
        family_check(opts)
        shm_check("the vLLM engine this regeneration starts")
        opts.tensor_parallel_size = engine_tensor_parallel(opts)


def check_before_engines(opts: RegenOptions) -> None:
    """`--check-only`: every argument check, and /dev/shm for the `--server` engines on this host (a
    loopback URL: regenerate_job starts them beside the job), before anything starts them."""
    check_options(opts)
    if any(on_this_host(url) for url in opts.servers):
        shm_check("each vLLM engine this regeneration uses on this host (--server)")


def on_this_host(url: str) -> bool:
    """A loopback URL (localhost, 127.0.0.0/8, ::1): the engine runs on this host."""
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ip_address(host).is_loopback
    except ValueError:
        return False


def shm_check(who: str) -> None:
    """/dev/shm for vLLM engines on this host: the trainer's gate (trainer/preflight/shm.py), one line."""
    from trainer.preflight.report import PreflightReport
    from trainer.preflight.shm import engine_shm_gate

    report = PreflightReport()
    engine_shm_gate(report, who)
    for p in report.errors:
        raise RegenerateError(f"[{p.code}] {p.message} (fix: {p.fix})")


def family_check(opts: RegenOptions) -> None:
    """The target's family in --dtype on the engine's platform (trainer/preflight/vllm_family.py): a
    combination vLLM cannot run is refused here, not at the first batch; `auto` becomes the dtype vLLM
    runs the family in there (bfloat16 for a Gated DeltaNet hybrid on a CPU)."""
    import torch

    from trainer.preflight.vllm_family import cpu_engine_problem, engine_dtype
    from trainer.target.info import read_config

    cpu = opts.device == "cpu" or not torch.cuda.is_available()
    conf = read_config(Path(opts.target))
    problem = cpu_engine_problem(conf, opts.dtype, cpu, "--dtype")
    if problem:
        raise RegenerateError(f"{problem}; use --dtype bfloat16 or auto, or --backend transformers")
    opts.dtype = engine_dtype(conf, opts.dtype, cpu)


def engine_tensor_parallel(opts: RegenOptions) -> int:
    """The vLLM backend's tensor-parallel size: `--tensor-parallel-size`, checked against the GPUs and
    the attention heads, or the plan's choice for the target on the GPUs this process sees
    (trainer/layout/inference.py, what `dflash plan` reports); before any engine starts."""
    from trainer.layout.inference import resolve_engine_tp
    from trainer.layout.recipe import PlanError

    gpus = (0, 0.0) if opts.device == "cpu" else None
    try:
        tp, why = resolve_engine_tp(opts.target, opts.tensor_parallel_size, "--tensor-parallel-size", gpus)
    except PlanError as exc:
        raise RegenerateError(str(exc)) from None
    if tp > 1:
        print(f"dflash regenerate: vLLM shards the target over {tp} GPUs ({why})", flush=True)
    return tp
