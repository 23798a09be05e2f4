"""`eval.holdout`: samples of the run's own data kept out of training (the sampler never packs them)
and evaluated on their prompts; the same ones on every rank and every restart; refused when nothing
would be left to train on."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import ValidationError

from trainer.config.eval import EvalConfig, holdout_file
from trainer.data import DataError, PackedSampler, holdout_indices, holdout_prompts
from trainer.training.evaluation import eval_command, hold_out


def dataset(n: int = 12):
    """Sample i: a 3-token prompt (ids 1000+10i ..) then 4 supervised tokens; every token unique to it."""
    import datasets

    ids = [[1000 + 10 * i + k for k in range(7)] for i in range(n)]
    mask = [[0, 0, 0, 1, 1, 1, 1] for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask})


def run_cfg(tmp_path, holdout, seed=0):
    ev = EvalConfig(holdout=holdout)
    return SimpleNamespace(eval=ev, train=SimpleNamespace(seed=seed), out_dir=str(tmp_path), target=None)


def test_held_out_samples_are_never_packed_and_their_prompts_are_evaluated(tmp_path):
    ds = dataset()
    usable = np.ones(12, dtype=bool)
    usable[5] = False  # a sample the data gate dropped is never held out either
    held = hold_out(run_cfg(tmp_path, 3), ds, usable, is_main=True)
    assert held.size == 3 and 5 not in held and not usable[held].any() and usable.sum() == 8
    rows = [json.loads(line) for line in holdout_file(tmp_path).read_text().splitlines()]
    assert rows == [{"input_ids": [1000 + 10 * int(i) + k for k in range(3)]} for i in held]
    sampler = PackedSampler(ds, usable, max_tokens=14, seed=0)
    seen = set()
    for _ in range(40):  # 5 epochs of 8 usable samples, two per pack
        seen.update(int(t) // 10 - 100 for t in sampler.next_batch()["input_ids"])
    assert seen == set(np.flatnonzero(usable).tolist())

    again = np.ones(12, dtype=bool)
    again[5] = False
    assert (
        hold_out(run_cfg(tmp_path / "r2", 3), ds, again, is_main=False) == held
    ).all()  # a restart, a rank
    assert not holdout_file(tmp_path / "r2").exists(), "only the main process writes the prompts"
    other = holdout_indices(np.ones(12, dtype=bool), 3, seed=1)
    assert not (other == holdout_indices(np.ones(12, dtype=bool), 3, seed=0)).all()  # train.seed chooses


def test_holdout_refusals_and_where_eval_reads_its_prompts(tmp_path):
    with pytest.raises(DataError, match="eval.holdout 4: the dataset has 4 usable samples") as err:
        holdout_indices(np.ones(4, dtype=bool), 4, seed=0)
    assert err.value.code == "data.holdout_too_large"
    with pytest.raises(ValidationError, match="eval.prompts and eval.holdout both set"):
        EvalConfig(prompts="p.jsonl", holdout=2)
    assert not EvalConfig().enabled and EvalConfig(holdout=2).enabled
    assert holdout_prompts(dataset(2), np.array([1])) == [{"input_ids": [1010, 1011, 1012]}]

    cfg = run_cfg(tmp_path, 2)
    cfg.target = SimpleNamespace(path="/t")
    cmd = eval_command(cfg, tmp_path / "ck", tmp_path / "r.json", "cpu")
    assert cmd[cmd.index("--prompts") + 1] == str(tmp_path / "eval" / "holdout.jsonl")
    cfg.eval = EvalConfig(prompts="humaneval")
    cmd = eval_command(cfg, tmp_path / "ck", tmp_path / "r.json", "cpu")
    assert cmd[cmd.index("--prompts") + 1] == "humaneval"


def test_preflight_refuses_a_holdout_that_leaves_nothing_to_train_on(make_config):
    from tests.unit.test_preflight import assert_problem, preflight

    report = preflight(make_config, eval={"holdout": 48})  # tiny_data: 48 usable samples
    assert_problem(report, "data.holdout_too_large", "eval.holdout 48", "48 usable samples", "eval.prompts")
    assert "data.holdout_too_large" not in preflight(make_config, eval={"holdout": 47}).codes()
