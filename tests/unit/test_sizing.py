"""trainer/layout/sizing.py: the one memory model of `dflash plan` and `dflash preflight`, and what it
counts for the trainer as it runs (fp32 drafter, DDP, ZeRO-1 moments, FSDP2, full or chunked logits)."""

from pathlib import Path

import pytest

from trainer.config.run import load_config
from trainer.layout.recipe import Recipe, per_gpu_bytes, read_target
from trainer.layout.sizing import Shapes, per_device_bytes
from trainer.preflight.machine import estimate_memory
from trainer.target.info import TargetInfo

QWEN = Path(__file__).resolve().parents[1] / "fixtures" / "targets" / "qwen3.6-27b"
S = Shapes(
    target_params=27_000_000_000,
    target_dtype_bytes=2,
    hidden=5120,
    vocab=248320,
    intermediate=17408,
    heads=24,
    kv_heads=4,
    head_dim=256,
    draft_layers=1,
    n_aux=5,
)
KNOBS = {"tokens": 8192, "anchors": 512, "block": 16, "optimizer": "adamw"}  # AdamW's two moments


def parts(**kw):
    return per_device_bytes(S, **{"gpus_per_copy": 1, "data_parallel": 1, "device": "cuda", **KNOBS, **kw})


def test_each_shard_level_divides_what_it_shards():
    """none: everything whole (DDP's gradients are views into its buckets: no extra copy); optimizer:
    the moments / ranks; full (FSDP2): weights, gradients and moments / ranks plus the gathered
    working set (two draft layers in bf16 and the root group, one group's unsharded gradient)."""
    p = S.drafter_trainable
    solo, four, four_plain, four_full = (
        parts(),
        parts(data_parallel=4),
        parts(data_parallel=4, shard="none"),
        parts(data_parallel=4, shard="full"),
    )
    assert solo["drafter_optimizer"] == p * 8 == four_plain["drafter_optimizer"]
    assert four["drafter_optimizer"] == p * 8 / 4 == four_full["drafter_optimizer"]
    # resident: fp32 weights + autocast's bf16 casts; DDP's gradients (bucket views) too; FSDP2's shard
    assert solo["drafter_trainable"] == p * (4 + 2)
    assert four["drafter_trainable"] == four_plain["drafter_trainable"] == p * (4 + 4 + 2)
    assert four_full["drafter_trainable"] == p * 4 / 4
    # the step: gradients freed every step (one rank, FSDP2) + AdamW's foreach copy of what this rank
    # updates, beyond the activations and logits the backward freed (chunked, so the step shows)
    small = {"loss_chunk_rows": 64, "activation_checkpointing": True, "tokens": 256, "anchors": 8}
    one, zero, ddp, fsdp = (
        parts(**small),
        parts(data_parallel=4, **small),
        parts(data_parallel=4, shard="none", **small),
        parts(data_parallel=4, shard="full", **small),
    )
    freed = one["activations"] + one["logits"]
    assert freed < p * 4 / 4, "the shapes make every step part positive"
    assert one["drafter_step"] == p * 4 + p * 4 - freed
    assert zero["drafter_step"] == p * 4 / 4 - freed
    assert ddp["drafter_step"] == p * 4 - freed
    assert fsdp["drafter_step"] == (p * 4 + p * 4) / 4 - freed
    assert parts()["drafter_step"] == 0, "11 GiB of logits freed: the step fits in what the backward freed"
    layer = S.decoder_layer_params()
    root = p - layer  # one draft layer: fc + norms are the rest
    assert four_full["drafter_gathered"] == (1 * layer + root) * 2 + (layer + root) * 4
    assert solo["drafter_gathered"] == four["drafter_gathered"] == 0
    assert parts(shard="full") == solo, "one rank: every level is plain AdamW"
    with pytest.raises(ValueError, match="shard 'zero3'"):
        parts(shard="zero3")


def test_activation_checkpointing_keeps_one_layer_of_activations():
    """train.activation_checkpointing: each of 5 layers keeps its input; one layer's tensors return
    while its backward recomputes it."""
    s5 = Shapes(**{**S.__dict__, "draft_layers": 5})
    base = dict(gpus_per_copy=1, data_parallel=1, device="cuda", **KNOBS)
    off = per_device_bytes(s5, **base)["activations"]
    on = per_device_bytes(s5, activation_checkpointing=True, **base)["activations"]
    q, t = 512 * 16, 8192
    per_layer = 10 * q * S.hidden + 2 * (t + q) * S.kv_heads * S.head_dim + 4 * q * S.intermediate
    assert off - on == (5 * per_layer - (5 * q * S.hidden + per_layer)) * 2


def test_full_logits_fused_on_cuda_eager_on_cpu():
    q = 512 * 16
    assert parts()["logits"] == q * 248320 * 2 * 3
    cpu = parts(device="cpu")
    assert cpu["logits"] == q * 248320 * 4 * 3  # the eager peak measured by bench/memory.py
    assert cpu["runtime_reserve"] == 0 and parts()["runtime_reserve"] == 2**30
    assert cpu["drafter_trainable"] == S.drafter_trainable * 4  # no autocast copy on CPU


def test_chunked_loss_keeps_one_chunk_of_logits():
    """train.loss_chunk_rows (trainer/training/chunked_loss.py): the logit copies of N rows, not of
    every query row; a chunk larger than the query rows changes nothing; nothing else moves."""
    full, chunked = parts(), parts(loss_chunk_rows=1024)
    assert chunked["logits"] == 1024 * 248320 * 2 * 3 == full["logits"] / 8
    assert parts(loss_chunk_rows=10**6)["logits"] == full["logits"]
    assert {k: v for k, v in chunked.items() if k != "logits"} == {
        k: v for k, v in full.items() if k != "logits"
    }


def test_frozen_is_fp32_embed_plus_one_shared_head_bf16_under_autocast():
    own = {"share_embedding": False}  # train.share_target_embedding false: the drafter's own fp32 copy
    assert S.drafter_frozen == 2 * 248320 * 5120 + 5120
    assert parts(device="cpu", **own)["drafter_frozen"] == S.drafter_frozen * 4
    assert parts(**own)["drafter_frozen"] == (248320 * 5120 + 5120) * 4 + 248320 * 5120 * 2
    fp32_cuda = parts(activation_bytes=4, **own)  # train.precision float32 on CUDA: no autocast, fp32 head
    assert fp32_cuda["drafter_frozen"] == S.drafter_frozen * 4
    # shared (the default): the embedding is the target's, already in target_weights
    assert parts()["drafter_frozen"] == 5120 * 4 + 248320 * 5120 * 2
    assert parts(**own)["drafter_frozen"] - parts()["drafter_frozen"] == 248320 * 5120 * 4
    assert parts()["target_weights"] == parts(**own)["target_weights"]


def test_target_weights_split_over_the_copy():
    assert parts(gpus_per_copy=4)["target_weights"] == parts()["target_weights"] / 4
    with pytest.raises(ValueError):
        parts(device="tpu")


def test_plan_and_preflight_give_the_same_figures(make_config):
    """Same target, same knobs: `dflash plan` and preflight's memory gate are one model."""
    cfg = load_config(
        make_config(drafter={"aux_layer_ids": [2, 10, 18, 26, 34], "block_size": 16}),
        [
            f"target.path={QWEN}",
            "target.gpus_per_copy=2",
            "train.max_anchors=64",
            "train.loss_chunk_rows=256",
        ],
    )
    info = TargetInfo.from_folder(QWEN)
    t = read_target(QWEN / "config.json")
    from dataclasses import replace

    info = replace(info, stored_params=t.params)  # the fixture has the index, not the shards
    pre = estimate_memory(cfg, info, cuda=True, world_size=4)
    recipe = Recipe(cfg.drafter.num_layers, 5, 16, 64, cfg.train.max_tokens_per_batch, loss_chunk_rows=256)
    plan = per_gpu_bytes(t, 2, 4, recipe, cfg.train.shard)
    assert pre.keys() == plan.keys()
    for k in pre:
        assert pre[k] == pytest.approx(plan[k], rel=1e-3), k
    assert plan["logits"] == 256 * t.vocab * 2 * 3, "the chunk, not the 64 x 16 query rows"


def test_preflight_models_the_attention_the_drafter_runs_with(make_config):
    """drafter.attn_implementation sdpa on CUDA keeps k and v repeated to every query head and a dense
    mask per draft layer; auto (flex attention there) keeps neither. The model followed the device, so
    a CUDA run set to sdpa was modelled as flex attention."""
    from dataclasses import replace

    info = TargetInfo.from_folder(QWEN)
    info = replace(info, stored_params=read_target(QWEN / "config.json").params)

    def activations(impl: str, cuda: bool) -> float:
        cfg = load_config(
            make_config(drafter={"aux_layer_ids": [2, 10, 18, 26, 34], "attn_implementation": impl}),
            [f"target.path={QWEN}", "train.max_anchors=64"],
        )
        return estimate_memory(cfg, info, cuda=cuda, world_size=1)["activations"], cfg

    flex, cfg = activations("auto", cuda=True)
    sdpa, _ = activations("sdpa", cuda=True)
    tokens, q = cfg.train.max_tokens_per_batch, 64 * cfg.drafter.block_size
    t = read_target(QWEN / "config.json")
    dense = 2 * 2 * (tokens + q) * t.heads * t.head_dim + 4 * q * (tokens + q)  # bf16 k/v, fp32 mask
    assert sdpa - flex == pytest.approx(cfg.drafter.num_layers * dense, rel=1e-9)
    assert activations("auto", cuda=False)[0] == activations("sdpa", cuda=False)[0]


@pytest.mark.parametrize(
    "target_shape, drafter",
    [
        ({}, {"aux_layer_ids": [1, 2]}),
        ({}, {"aux_layer_ids": [1, 2, 3], "num_layers": 2}),
        ({}, {"aux_layer_ids": [1, 3], "intermediate_size": 48}),
        ({"hidden": 96, "num_layers": 6, "vocab": 640}, {"aux_layer_ids": [1, 3, 5], "num_layers": 3}),
    ],
    ids=["1-layer", "2-layers-3-aux", "narrow-mlp", "other-target"],
)
def test_the_models_parameter_counts_are_those_of_a_real_drafter(
    tmp_path, make_config, target_shape, drafter
):
    """Shapes' counts against `numel` of a drafter built by build_drafter (speculators' DFlash model),
    not against the model's own arithmetic: trainable = the parameters that require grad, frozen = the
    distinct frozen tensors (lm_head and verifier_lm_head share one)."""
    import torch

    from trainer.demo.synth import tiny_target
    from trainer.drafter.model import build_drafter

    overrides = []
    if target_shape:
        target = tiny_target(tmp_path / "target", **target_shape)
        overrides = [f"target.path={target}"]
    cfg = load_config(make_config(drafter={"mask_token_id": 3, **drafter}), overrides)
    model = build_drafter(cfg, torch.device("cpu"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = {p.data_ptr(): p.numel() for p in model.parameters() if not p.requires_grad}
    shapes = TargetInfo.from_folder(Path(cfg.target.path)).shapes(cfg)
    assert shapes.drafter_trainable == trainable
    assert shapes.drafter_frozen == sum(frozen.values())
