"""The model card `dflash export --push-to-hub` writes (trainer/hub/card.py): the τ table per prompt set
(chain, tree per budget, vLLM) from the run's `eval` events of the exported checkpoint, "not measured"
without them, the serve line with the Hub repo, and the same bytes for the same records; and the
checks trainer/hub/push.py makes before any export work (repo name, token, offline, a rerun's --out)."""

from __future__ import annotations

import json

import pytest

from trainer.hub.card import render_card, tau_table


def export_info(run, step=40, name="step-00000040"):
    return {
        "source": str(run / "checkpoints" / name),
        "step": step,
        "verifier": "Qwen/Qwen3-8B",
        "block_size": 16,
        "aux_layer_ids": [1, 17, 33],
        "files": {"config.json": "a" * 64, "model.safetensors": "b" * 64},
    }


def write_run(run, events):
    (run / "checkpoints" / "step-00000040").mkdir(parents=True)
    config = {
        "train": {"max_steps": 100, "optimizer": "muon", "lr": 6e-4, "position_weights": "dpace"},
        "drafter": {"num_layers": 5, "block_size": 16},
        "data": {"path": "/data/regen-qwen3", "max_length": 4096},
    }
    lines = [{"event": "run_start", "config": config}, *events]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_the_tau_table_has_one_row_per_prompt_set_with_chain_tree_and_vllm(tmp_path):
    ev = {"event": "eval", "checkpoint": "step-00000040", "num_prompts": 80, "block_size": 16}
    write_run(
        tmp_path,
        [
            {**ev, "prompts": "gsm8k", "tau": 2.5, "lossless_ok": True},  # superseded by the next one
            {**ev, "prompts": "gsm8k", "tau": 3.25, "tree_tau": {"16": 4.0, "64": 4.5}, "lossless_ok": True},
            {**ev, "prompts": "/data/mine/mt-bench.jsonl", "tau": 3.0, "tau_vllm": 2.9, "lossless_ok": True},
            {**ev, "checkpoint": "step-00000020", "prompts": "math500", "tau": 9.9},  # another checkpoint
        ],
    )
    card = render_card(export_info(tmp_path), "my-org/qwen3-8b-dflash")
    assert (
        "| prompts | prompts evaluated | block | chain τ | tree τ (16) | tree τ (64) | vLLM τ | lossless |"
        in card
    )
    assert "| gsm8k | 80 | 16 | 3.250 | 4.000 | 4.500 | – | ok |" in card
    assert "| mt-bench.jsonl | 80 | 16 | 3.000 | – | – | 2.900 | ok |" in card
    assert "math500" not in card and "9.9" not in card
    assert '"model": "my-org/qwen3-8b-dflash", "num_speculative_tokens": 15' in card
    assert "vllm serve Qwen/Qwen3-8B " in card and "base_model: Qwen/Qwen3-8B" in card
    assert "steps | 40 of 100" in card and 'optimizer "muon"' in card and "`regen-qwen3`" in card
    assert render_card(export_info(tmp_path), "my-org/qwen3-8b-dflash") == card  # same records, same bytes


def test_without_eval_events_tau_is_not_measured(tmp_path):
    write_run(tmp_path, [])
    card = render_card(export_info(tmp_path), "org/x")
    assert "Not measured" in card and "| chain τ |" not in card
    assert tau_table([]) == [
        "Not measured: the run recorded no `dflash eval` of this checkpoint (`eval` events)."
    ]
    lone = render_card({**export_info(tmp_path / "elsewhere"), "verifier": "/models/local"}, "org/x")
    assert "recipe | not recorded" in lone and "base_model" not in lone  # a local path is no Hub id


def test_the_recipe_row_leaves_out_the_knobs_the_run_did_not_use(tmp_path):
    write_run(tmp_path, [])  # muon, dpace weights
    card = render_card(export_info(tmp_path), "org/x")
    assert 'position_weights "dpace"' in card and "gamma" not in card


def test_a_push_that_cannot_happen_is_refused_before_the_export(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    from trainer.hub.pull import HubError
    from trainer.hub.push import prepare

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_from_the_login")
    with pytest.raises(HubError, match="name the repo as ORG/NAME"):
        prepare("just-a-name")
    with pytest.raises(HubError, match="names revision 'main' but --revision says 'v2'"):
        prepare("org/x@main", "v2")
    assert prepare("org/x", "v2").token == "hf_from_the_login"
    token = tmp_path / "token"
    token.write_text("hf_from_the_file\n")
    push = prepare("org/x", token_file=str(token))
    assert (push.repo, push.revision, push.token) == ("org/x", "main", "hf_from_the_file")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(HubError, match="needs a Hub token with write access"):
        prepare("org/x")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set"):
        prepare("org/x", token_file=str(token))

    # a rerun pushes the export already in --out; anything else there is refused
    out = tmp_path / "export"
    assert push.reuses(out, tmp_path / "run") is False
    out.mkdir()
    with pytest.raises(HubError, match="is not a finished export"):
        push.reuses(out, tmp_path / "run")
    (out / "dflash_export.json").write_text(json.dumps({"source": str(tmp_path / "run/checkpoints/step-9")}))
    assert push.reuses(out, tmp_path / "run") is True  # the run's out_dir: its checkpoint
    with pytest.raises(HubError, match="not of --checkpoint"):
        push.reuses(out, tmp_path / "other-run")
