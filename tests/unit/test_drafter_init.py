"""`drafter.init: target` (trainer/drafter/target_init.py): the drafter's layers start as the target's last
layers, on real tiny Qwen3 and Llama targets built on the spot; a target whose last layers cannot be
copied is refused by preflight (exit 2) and again at the build, naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.config.run import load_config
from trainer.drafter.model import build_drafter
from trainer.drafter.target_init import DrafterInitError, init_from_target, plan_target_init
from trainer.preflight import run_preflight

PARTS = [
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.o_proj",
    "mlp.down_proj",
]


def built(make_config, *overrides: str, **drafter):
    cfg = load_config(make_config(drafter={"num_layers": 2, **drafter}), list(overrides))
    torch.manual_seed(0)
    return cfg, build_drafter(cfg, torch.device("cpu"))


def test_the_drafter_starts_as_the_targets_last_layers_and_reads_its_deepest_aux_layer(
    tiny_target, make_config
):
    cfg, model = built(make_config, init="target")
    target = load_file(str(tiny_target / "model.safetensors"))
    layers = json.loads((tiny_target / "config.json").read_text())["num_hidden_layers"]  # 4
    params = dict(model.named_parameters())
    for j, src in enumerate(range(layers - 2, layers)):
        for part in [*PARTS, "self_attn.q_norm", "self_attn.k_norm", "mlp.up_proj"]:
            assert torch.equal(
                params[f"layers.{j}.{part}.weight"], target[f"model.layers.{src}.{part}.weight"]
            ), (
                j,
                part,
            )
    assert torch.equal(params["norm.weight"], target["model.norm.weight"]), "the target's final norm"
    assert torch.equal(
        params["hidden_norm.weight"], target[f"model.layers.{layers - 2}.input_layernorm.weight"]
    )
    fc, hidden = params["fc.weight"], 64  # aux layers [1, 2]: the deepest (2) is the second block
    assert torch.equal(fc[:, hidden:], torch.eye(hidden)) and not fc[:, :hidden].any()
    assert all(p.requires_grad for n, p in params.items() if n.startswith(("layers.", "fc.", "norm.")))

    _, fresh = built(make_config)  # the default: nothing of the target's layers
    assert not torch.equal(
        dict(fresh.named_parameters())["layers.0.self_attn.q_proj.weight"],
        params["layers.0.self_attn.q_proj.weight"],
    )


def test_a_llama_target_without_q_and_k_norms_is_copied_and_its_norms_stay_ones(make_config, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    shape = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3}
    shape |= {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
    }
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(str(tmp_path / "llama"))
    _, model = built(
        make_config, f"target.path={json.dumps(str(tmp_path / 'llama'))}", init="target", num_layers=1
    )
    target = load_file(str(tmp_path / "llama" / "model.safetensors"))
    params = dict(model.named_parameters())
    for part in PARTS:
        assert torch.equal(params[f"layers.0.{part}.weight"], target[f"model.layers.2.{part}.weight"]), part
    assert torch.equal(params["layers.0.self_attn.q_norm.weight"], torch.ones(16)), "none in a Llama layer"


def test_layers_that_cannot_be_copied_are_named(tiny_target):
    """A hybrid target whose last layer is linear attention, a drafter deeper than the target, an MLP
    width of its own: each is a problem naming what is wrong (the plan reads headers only)."""
    from trainer.target.info import read_weight_headers

    tensors = read_weight_headers(tiny_target).tensors
    assert plan_target_init(tensors, 4, 2).problems == []
    hybrid = {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.self_attn.")}
    hybrid["model.layers.3.linear_attn.in_proj_qkvz.weight"] = {"shape": [256, 64]}
    problems = plan_target_init(hybrid, 4, 2).problems
    assert any(
        "model.layers.3.self_attn.q_proj.weight" in p and "not a plain attention layer" in p for p in problems
    )
    assert "the drafter has 5 layers, the target only 4" in plan_target_init(tensors, 4, 5).problems
    assert any(
        "intermediate_size is 32" in p and "128 wide" in p
        for p in plan_target_init(tensors, 4, 1, 32).problems
    )


def test_preflight_refuses_what_init_target_cannot_do_and_the_build_checks_again(
    tiny_target, make_config, tmp_path, capsys
):
    from trainer.cli import main

    report = run_preflight(load_config(make_config(drafter={"init": "target", "intermediate_size": 32})))
    [problem] = [p for p in report.errors if p.code == "config.init_target_layers"]
    assert "intermediate_size is 32" in problem.message and "drafter.init: random" in problem.fix
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    report = run_preflight(load_config(make_config(drafter={"init": "target", "warm_start": str(ckpt)})))
    assert "config.init_with_warm_start" in report.codes()
    rc = main(
        ["preflight", "--config", str(make_config(drafter={"init": "target", "intermediate_size": 32}))]
    )
    assert rc == 2 and "intermediate_size is 32" in capsys.readouterr().out

    cfg, model = built(make_config, intermediate_size=32)  # a drafter built apart from preflight
    before = model.layers[0].self_attn.q_proj.weight.clone()
    with pytest.raises(DrafterInitError, match="intermediate_size is 32"):
        init_from_target(model, Path(cfg.target.path), 4, 32)
    assert torch.equal(model.layers[0].self_attn.q_proj.weight, before), "nothing copied"
