"""What an evaluation holds beside the target (trainer/layout/eval_memory.py, issue #46 items 6-7): the
drafter's bytes as `dflash eval` loads it, measured on a real tiny drafter loaded the way eval loads it
(trainer/eval/models.py `load_drafter`, on the CPU: the same tensors and dtypes a GPU would get), and
how device_map's placement is modelled. No GPU here: the CUDA allocator's own overhead is not measured."""

from pathlib import Path

import pytest

from trainer.layout.eval_memory import (
    device_map_fill,
    drafter_shapes,
    eval_drafter,
    eval_drafter_weight_bytes,
)
from trainer.layout.recipe import Recipe, read_target, shapes

ROOT = Path(__file__).resolve().parents[2]
Q32 = ROOT / "tests" / "fixtures" / "targets" / "qwen3-32b"


def _saved_drafter(make_config, tmp_path, drafter: dict) -> tuple[Path, Path]:
    import torch

    from trainer.config.run import load_config
    from trainer.drafter.model import build_drafter

    cfg = load_config(make_config(drafter={"mask_token_id": 3, **drafter}))
    model = build_drafter(cfg, torch.device("cpu"))
    folder = tmp_path / "ckpt"
    model.save_pretrained(str(folder))
    return folder, Path(cfg.target.path)


def _held_bytes(model) -> int:
    """Bytes of every distinct storage the loaded drafter holds (parameters and buffers)."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("drafter", [{}, {"num_layers": 2}], ids=["1-layer", "2-layers"])
def test_the_formula_is_the_bytes_of_a_drafter_loaded_as_eval_loads_it(make_config, tmp_path, drafter):
    """Measured: a tiny checkpoint saved by speculators, loaded by `load_drafter` (fp32, the target's
    embedding and head read in); the bytes of its storages equal eval_drafter_weight_bytes exactly.
    The head is one tensor (lm_head is verifier_lm_head): two vocab x hidden matrices, not three."""
    import torch

    from trainer.eval.models import load_drafter

    folder, target = _saved_drafter(make_config, tmp_path, drafter)
    model = load_drafter(folder, target, torch.device("cpu"))
    assert model.lm_head.weight is model.verifier_lm_head.weight
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    t = read_target(target)
    found = drafter_shapes(folder, shapes(t, Recipe(1, 5, 8, 1, 1, optimizer="adamw")))
    assert found is not None
    s, block = found
    assert s.draft_layers == drafter.get("num_layers", 1) and block == model.config.block_size
    assert eval_drafter_weight_bytes(s) == _held_bytes(model)


def test_a_32b_drafter_is_counted_in_fp32_with_two_vocabulary_matrices():
    t = read_target(Q32)
    s = shapes(t, Recipe(draft_layers=1, n_aux=5, block=16, anchors=512, tokens=8192, optimizer="adamw"))
    d = eval_drafter(s, 4096, 16)
    vocab_matrix = 151936 * 5120 * 4
    assert 2 * vocab_matrix < d["drafter_weights"] < 3 * vocab_matrix
    assert 8.0 < d["drafter_weights"] / 2**30 < 8.3  # 5.8 GiB of frozen + 2.3 GiB for one layer and fc
    five = shapes(t, Recipe(draft_layers=5, n_aux=5, block=16, anchors=512, tokens=8192, optimizer="adamw"))
    assert 15.0 < eval_drafter(five, 4096, 16)["drafter_weights"] / 2**30 < 16.0


def test_device_map_fill_balances_then_fills_in_order():
    # 4 units of 10 on 2 GPUs, caps 100 each: balanced cap 20 + 12.5 on GPU 0, less the 10 reserved
    assert device_map_fill([10, 10, 10, 10], [100, 100], 10) == [20, 20]
    # a lowered GPU 0 (the drafter there) pushes the layers to the next GPUs
    assert device_map_fill([10, 10, 10, 10], [25, 100, 100], 10) == [10, 20, 10]
    assert device_map_fill([10, 10, 10, 10], [15, 15], 10) is None, "no GPU holds the last units"


def _cached_set(hf_home: Path, repo: str, filename: str, text: str) -> Path:
    """A dataset file laid out as huggingface_hub's cache holds it (refs/main -> a snapshot)."""
    root = hf_home / "hub" / ("datasets--" + repo.replace("/", "--"))
    commit = "0" * 40
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    path = root / "snapshots" / commit / filename
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_a_named_set_is_found_where_the_service_looks(tmp_path):
    """The trainer_service role runs the trainer with HOME = the run folder, HF_HUB_OFFLINE=1 and HF_HOME =
    trainer_service_hf_home (a node-wide cache). A set placed in that cache is found by a process with
    exactly that environment (a fresh interpreter: huggingface_hub reads HF_HOME at import); with the
    default HF_HOME under HOME it is not."""
    import os
    import subprocess
    import sys

    import yaml

    hf_home = tmp_path / "dflash" / "hf"
    _cached_set(hf_home, "HuggingFaceH4/MATH-500", "test.jsonl", '{"problem": "1+1?"}\n{"problem": "2+2?"}\n')
    run_dir = tmp_path / "dflash" / "runs" / "r"
    run_dir.mkdir(parents=True)
    code = "from trainer.eval.benchmarks import prompt_lines; print(len(prompt_lines('math500')))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HOME=str(run_dir), HF_HUB_OFFLINE="1")
    found = subprocess.run(
        [sys.executable, "-c", code], env={**env, "HF_HOME": str(hf_home)}, capture_output=True, text=True
    )
    assert found.returncode == 0 and found.stdout.strip() == "2", found.stderr
    lost = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert lost.returncode != 0 and "is not in the Hugging Face cache" in lost.stderr
    # the role's environment names that cache
    defaults = yaml.safe_load((ROOT / "roles" / "trainer_service" / "defaults" / "main.yml").read_text())
    assert defaults["trainer_service_hf_home"] == "{{ dflash_root }}/hf"
    env_all = (ROOT / "roles" / "trainer_service" / "vars" / "main.yml").read_text()
    assert "'HF_HOME': trainer_service_hf_home" in env_all


def test_the_child_gets_the_gpus_eval_device_names():
    from trainer.config.eval import EvalConfig
    from trainer.training.evaluation import eval_device

    assert eval_device("cuda:5,6,7", "cuda:0") == ("cuda", "5,6,7")
    assert EvalConfig(prompts="x", device="cuda:5,6,7").device == "cuda:5,6,7"
    with pytest.raises(ValueError, match="cuda:N"):
        EvalConfig(prompts="x", device="cuda:5,")
