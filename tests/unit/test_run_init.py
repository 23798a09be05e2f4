"""`dflash init` (trainer/run_init.py): a run config for a causal LM from its folder.

- examples/: each family's run.yaml is what init writes now from its config.json (so they cannot drift),
  and it passes every preflight check that needs neither weights nor data nor this machine;
- the rules: aux ids = z-lab's spacing in speculators' convention, the mask token a row no text maps to
  (checked by preflight's own mask checks, which now also read the tokenizer);
- on a tiny real target with a tokenizer and a dataset, the config passes the whole preflight unchanged;
- every bad input is exit 2 with its message, never a traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.config.run import DrafterConfig, load_config
from trainer.preflight import run_preflight
from trainer.preflight.drafter import drafter_gate
from trainer.preflight.report import PreflightReport
from trainer.run_init import build, choose_mask
from trainer.target.info import TargetInfo
from trainer.target.tokenizer import TokenizerFiles

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
FAMILIES = sorted(p.name for p in EXAMPLES.iterdir() if (p / "target" / "config.json").is_file())
# what preflight cannot pass without the weights and the data (and, for the machine, on this one)
NEEDS_FILES = {"config.target_no_weights", "data.missing"}


def test_the_examples_hold_the_five_families():
    assert FAMILIES == ["gpt-oss-20b", "llama-3.1-8b-instruct", "qwen3-30b-a3b", "qwen3-8b", "qwen3.6-27b"]


def test_the_seeds_target_example_is_the_fixture():
    """examples/qwen3.6-27b is the seeds' target: its config.json is the planner's fixture, and init's aux
    ids are SpecForge's Qwen3.6-27B recipe's [1, 16, 31, 46, 61] in speculators' convention."""
    fixture = REPO / "tests" / "fixtures" / "targets" / "qwen3.6-27b" / "config.json"
    assert (EXAMPLES / "qwen3.6-27b" / "target" / "config.json").read_text() == fixture.read_text()
    assert load_config(EXAMPLES / "qwen3.6-27b" / "run.yaml").drafter.aux_ids == [2, 17, 32, 47, 62]


@pytest.mark.parametrize("family", FAMILIES)
def test_example_is_what_init_writes_now(family, monkeypatch):
    monkeypatch.chdir(EXAMPLES)
    result = build(Path(family, "target"), Path(family, "data"), Path(family, "run.yaml"))
    assert (EXAMPLES / family / "run.yaml").read_text() == result.text, (
        f"examples/{family}/run.yaml is stale: regenerate it (examples/README.md)"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_example_passes_preflight_but_for_weights_and_data(family):
    cfg = load_config(EXAMPLES / family / "run.yaml")
    report = run_preflight(cfg)
    found = {p.code for p in report.errors + report.warnings}
    assert NEEDS_FILES <= found  # the examples ship no weights and no data
    left = {c for c in found - NEEDS_FILES if not c.startswith(("machine.", "kernels."))}
    assert left == set(), [p for p in report.errors + report.warnings if p.code in left]


def test_aux_ids_follow_the_paper_and_the_mask_a_free_row():
    cfg = {f: load_config(EXAMPLES / f / "run.yaml").drafter for f in FAMILIES}
    # z-lab's Qwen3-8B drafter reads layers [1, 9, 17, 25, 33] (their convention) = speculators' ids
    assert cfg["qwen3-8b"].aux_ids == [2, 10, 18, 26, 34]
    assert cfg["qwen3-30b-a3b"].aux_ids == [2, 13, 24, 35, 46]
    assert cfg["llama-3.1-8b-instruct"].aux_ids == [2, 9, 16, 23, 30]
    assert cfg["gpt-oss-20b"].aux_ids == [2, 7, 12, 17, 22]
    # no tokenizer in the folders: the last embedding row (Qwen3: a padding row past the tokenizer's
    # 151669 ids; Llama 3: <|reserved_special_token_247|>; gpt-oss: a reserved id of o200k_harmony;
    # Qwen3.6: the last padding row; SpecForge's recipe, with the tokenizer, uses 248070)
    assert [cfg[f].mask_token_id for f in FAMILIES] == [201087, 128255, 151935, 151935, 248319]
    # block size and the levers are the schema's defaults, not restated
    assert {c.block_size for c in cfg.values()} == {DrafterConfig.model_fields["block_size"].default}


def test_cli_writes_the_example_atomically_and_refuses_to_overwrite(tmp_path, monkeypatch, capsys):
    family = tmp_path / "qwen3-8b"
    shutil.copytree(EXAMPLES / "qwen3-8b" / "target", family / "target")
    monkeypatch.chdir(tmp_path)
    args = ["init", "--target", "qwen3-8b/target", "--data", "qwen3-8b/data", "--out", "qwen3-8b/run.yaml"]
    assert main(args) == 0
    assert (family / "run.yaml").read_text() == (EXAMPLES / "qwen3-8b" / "run.yaml").read_text()
    assert sorted(p.name for p in family.iterdir()) == ["run.yaml", "target"]  # no temp file left
    out = capsys.readouterr()
    assert "mask_token_id 151935" in out.out and "dflash preflight --config qwen3-8b/run.yaml" in out.out
    (family / "run.yaml").write_text("mine\n")
    assert main(args) == 2
    assert "exists: pass --force" in capsys.readouterr().err
    assert (family / "run.yaml").read_text() == "mine\n"
    assert main([*args, "--force", "--mask-token-id", "151669"]) == 0
    assert load_config(family / "run.yaml").drafter.mask_token_id == 151669


# ---------------------------------------------------------------- the mask token with a tokenizer


def write_tokenizer(folder: Path, words: int, specials: list[str], template: str = "", **roles: str) -> None:
    """A word-level tokenizer.json (+ tokenizer_config.json) by hand: `specials` get ids 0.., then
    `words` plain tokens."""
    added = [{"id": i, "content": s, "special": True} for i, s in enumerate(specials)]
    vocab = {s: i for i, s in enumerate(specials)} | {f"w{i}": len(specials) + i for i in range(words)}
    tok = {"added_tokens": added, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    conf = {**roles, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(conf))


def target_info(vocab: int, eos: int = 2, pad: int = 0) -> TargetInfo:
    conf = {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": vocab,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    return TargetInfo.from_config(conf, Path("config.json"))


def test_mask_is_the_first_row_past_the_tokenizer(tmp_path):
    write_tokenizer(tmp_path, 400, ["<pad>", "<s>", "</s>", "<unk>"], eos_token="</s>")
    tok = TokenizerFiles.from_folder(tmp_path)
    assert tok is not None and tok.size == 404 and tok.role_ids == {"eos": 2}
    assert choose_mask(target_info(512), tok)[0] == 404  # where speculators adds <|MASK|>


def test_mask_is_an_unused_special_token_when_the_tokenizer_fills_the_embedding(tmp_path):
    # SmolLM2's shape: the chat template writes <|im_start|>/<|im_end|>, <empty_output> is free (id 16)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<empty_output>", "<unk>"]
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    write_tokenizer(tmp_path, 507, specials, template, eos_token="<|im_end|>", unk_token="<unk>")
    tok = TokenizerFiles.from_folder(tmp_path)
    assert tok is not None and tok.size == 512
    mask, why = choose_mask(target_info(512, eos=2, pad=0), tok)
    assert mask == 3 and "'<empty_output>'" in why  # <unk> (4) is the tokenizer's unk token


def test_without_the_base_vocabulary_no_row_is_taken_for_past_the_tokenizer(tmp_path):
    # a sentencepiece tokenizer (tokenizer.model, not read here): only tokenizer_config.json's added
    # tokens are known, so id 3 is not "past the tokenizer"; an unused added special token is taken
    decoder = {str(i): {"content": c, "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])}
    decoder["31999"] = {"content": "<reserved_0>", "special": True}
    conf = {"added_tokens_decoder": decoder, "eos_token": "</s>", "unk_token": "<unk>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    tok = TokenizerFiles.from_folder(tmp_path)
    assert tok is not None and tok.size is None and tok.role_ids == {"eos": 2, "unk": 0}
    assert choose_mask(target_info(32000, eos=2, pad=0), tok)[0] == 31999


def test_preflight_refuses_a_mask_the_chat_template_writes(tmp_path):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    write_tokenizer(tmp_path, 509, specials, "<|im_start|>{{ m }}<|im_end|>", eos_token="<|im_end|>")
    cfg = load_config(write_run(tmp_path, mask=1))
    report = PreflightReport()
    drafter_gate(cfg, target_info(512, eos=2, pad=0), report)
    assert report.codes() == ["config.mask_token_in_template"]
    assert "'<|im_start|>'" in report.errors[0].message
    with pytest.raises(Exception, match="no unused row"):
        choose_mask(target_info(512, eos=2, pad=0), TokenizerFiles.from_folder(tmp_path))


def write_run(folder: Path, mask: int) -> Path:
    path = folder / "run.yaml"
    path.write_text(
        f"target: {{path: {folder}}}\ndata: {{path: {folder}/data}}\n"
        f"drafter: {{aux_layer_ids: [1, 4], mask_token_id: {mask}}}\nout_dir: {folder}/out\n"
    )
    return path


# ---------------------------------------------------------------- a tiny real target: the whole preflight


def test_init_on_a_tiny_real_target_passes_the_whole_preflight(tiny_target, tmp_path, capsys):
    import datasets

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    write_tokenizer(target, 400, ["<pad>", "<s>", "</s>", "<unk>"], eos_token="</s>", pad_token="<pad>")
    rows = [[5 + (7 * i + j) % 390 for j in range(48)] for i in range(12)]
    masks = [[0] * 16 + [1] * 32 for _ in rows]
    datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": masks}).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "run.yaml"
    assert main(["init", "--target", str(target), "--data", str(tmp_path / "data"), "--out", str(out)]) == 0
    cfg = load_config(out)
    assert cfg.drafter.mask_token_id == 404 and cfg.drafter.aux_ids == [1, 2, 3, 4]
    cfg.train.max_tokens_per_batch = 512  # this machine's memory, not the config's content
    report = run_preflight(cfg)
    assert report.ok and not report.warnings, report.render_text()


# ---------------------------------------------------------------- bad inputs: exit 2 with a message


def bad_inputs(tmp: Path) -> list[tuple[str, str]]:
    (tmp / "empty").mkdir()
    (tmp / "a-file").write_text("x")
    for name, conf in {
        "bert": {"architectures": ["BertModel"], "num_hidden_layers": 12},
        "nolayers": {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 10},
        "broken": None,
    }.items():
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text("{not json" if conf is None else json.dumps(conf))
    return [
        (str(tmp / "missing"), "does not exist"),
        (str(tmp / "a-file"), "is a file, not a model folder"),
        ("Qwen/Qwen3-8B", "no local copy: sync it first with data_sync"),
        (str(tmp / "empty"), "has no config.json"),
        (str(tmp / "bert"), "names no causal language model"),
        (str(tmp / "nolayers"), "lacks 'num_hidden_layers'"),
        (str(tmp / "broken"), "is not readable JSON"),
    ]


def test_a_hub_repo_id_is_read_from_the_local_hub_cache_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    args = ["init", "--target", "Qwen/Qwen3-8B", "--data", "data", "--out", "run.yaml"]
    assert main(args) == 2
    assert "no local copy: sync it first with data_sync" in capsys.readouterr().err
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B"
    shutil.copytree(EXAMPLES / "qwen3-8b" / "target", repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert main(args) == 0
    # target.path is the node's folder the data_sync hf item writes, never this machine's cache path;
    # the Hub name, that item and the plan command that reads the config from the Hub are in the header
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.target.path == Path("/opt/dflash/target")
    text = (tmp_path / "run.yaml").read_text()
    assert str(tmp_path / "hub") not in text
    assert "The target is the Hub's Qwen/Qwen3-8B" in text
    assert 'src: "hf://Qwen/Qwen3-8B@main", dest: /opt/dflash/target, direction: hf' in text
    assert "dflash plan --config run.yaml --target-config hf://Qwen/Qwen3-8B@main" in text
    out = capsys.readouterr().out
    assert "target.path /opt/dflash/target: the node's copy of the Hub's Qwen/Qwen3-8B" in out
    # the recipe is the one the local folder gives; the header aside, the same file
    local = build(EXAMPLES / "qwen3-8b" / "target", Path("data"), tmp_path / "run.yaml")
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body == [
        "  path: /opt/dflash/target" if line.startswith("  path: ") and "target" in line else line
        for line in local.text.splitlines()
        if not line.startswith("#")
    ]
    # --target-path: another node folder
    args += ["--force", "--target-path", "/data/models/qwen3-8b"]
    assert main(args) == 0
    assert load_config(tmp_path / "run.yaml").target.path == Path("/data/models/qwen3-8b")
    assert "dest: /data/models/qwen3-8b, direction: hf" in (tmp_path / "run.yaml").read_text()


def test_bad_inputs_exit_2_with_their_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run.yaml"
    for target, words in bad_inputs(tmp_path):
        assert main(["init", "--target", target, "--data", "data", "--out", str(out)]) == 2, target
        err = capsys.readouterr().err
        assert err.startswith("dflash init: ") and words in err and "Traceback" not in err, err
        assert not out.exists()
    good = str(EXAMPLES / "qwen3-8b" / "target")
    for extra, words in [
        (["--mask-token-id", "151645"], "is the target's eos token id"),
        (["--mask-token-id", "151936"], "outside the target vocabulary"),
        (["--out", str(tmp_path)], "is a folder"),
    ]:
        try:
            code = main(["init", "--target", good, "--data", "data", "--out", str(out), *extra])
        except SystemExit as exc:  # an argument's own type refuses it (argparse: exit 2, one line)
            code = exc.code
        assert code == 2, extra
        assert words in capsys.readouterr().err
