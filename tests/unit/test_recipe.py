"""The recipe's levers, each on real tensors: the draft vocabulary (drafter.draft_vocab_size), D-PACE
position weights (train.position_weights), Muon + AdamW as one optimizer (train.optimizer), and what
the memory model makes of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.config.run import load_config


# ---------------------------------------------------------------- draft vocabulary
def test_the_mapping_keeps_the_most_frequent_tokens_and_every_kept_token_maps_back():
    from trainer.drafter.vocab import DraftVocabError, build_draft_vocab

    counts = np.zeros(50, dtype=np.int64)
    counts[[7, 3, 40, 11, 12]] = [100, 90, 80, 5, 5]  # 11 and 12 tie: the lower id wins
    dv = build_draft_vocab(counts, 4)
    kept = dv.target_ids()
    assert kept.tolist() == [3, 7, 11, 40], "the 4 most frequent, ties by id, in id order"
    assert dv.t2d.dtype == torch.bool and int(dv.t2d.sum()) == 4 and dv.t2d[kept].all()
    assert torch.equal(torch.nonzero(dv.t2d).flatten(), kept), "t2d and d2t describe the same tokens"
    assert dv.coverage == pytest.approx(275 / 280)
    # fewer distinct tokens than asked: topped up with the lowest unused ids, still a bijection
    few = build_draft_vocab(counts, 8)
    assert sorted(set(few.target_ids().tolist())) == few.target_ids().tolist()
    assert {3, 7, 11, 12, 40} <= set(few.target_ids().tolist()) and few.coverage == 1.0
    for bad in (1, 50, 60):
        with pytest.raises(DraftVocabError, match="draft_vocab_size"):
            build_draft_vocab(counts, bad)


def test_supervised_counts_skip_prompts_and_refuse_ids_outside_the_vocabulary(tmp_path):
    import datasets

    from trainer.drafter.vocab import DraftVocabError, supervised_token_counts

    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3, 3], [4, 3]], "loss_mask": [[0, 0, 1, 1], [1, 0]]}
    )
    counts = supervised_token_counts(ds, 10)
    assert counts.tolist() == [0, 0, 0, 2, 1, 0, 0, 0, 0, 0]
    with pytest.raises(DraftVocabError, match="outside the target's vocabulary of 4"):
        supervised_token_counts(ds, 4)


def test_a_draft_vocab_drafter_scores_the_targets_own_rows_of_the_kept_tokens(
    make_config, tiny_target, tiny_data
):
    from safetensors.torch import load_file

    from trainer.data import open_dataset
    from trainer.drafter.model import build_drafter
    from trainer.drafter.vocab import build_draft_vocab, supervised_token_counts

    cfg = load_config(make_config(drafter={"draft_vocab_size": 96}))
    d = build_drafter(cfg, torch.device("cpu"))
    head = load_file(str(tiny_target / "model.safetensors"))["lm_head.weight"]
    want = build_draft_vocab(supervised_token_counts(open_dataset(tiny_data), head.shape[0]), 96)
    assert d.use_draft_vocab and torch.equal(d.d2t, want.d2t) and torch.equal(d.t2d, want.t2d)
    rows = head[want.target_ids()]
    assert torch.equal(d.lm_head.weight, rows) and torch.equal(d.verifier_lm_head.weight, rows)
    assert d.lm_head.weight is not d.verifier_lm_head.weight and not d.lm_head.weight.requires_grad
    assert d.embed_tokens.weight.shape[0] == head.shape[0], "the input embedding keeps the whole vocabulary"
    assert 0 < d.draft_vocab_coverage <= 1


def test_a_resume_refuses_a_checkpoint_with_another_draft_vocabulary(make_config, tmp_path):
    from trainer.drafter.model import build_drafter, check_same_draft_vocab

    reduced = build_drafter(load_config(make_config(drafter={"draft_vocab_size": 96})), torch.device("cpu"))
    reduced.save_pretrained(str(tmp_path / "reduced"))
    check_same_draft_vocab(reduced, tmp_path / "reduced" / "model.safetensors")
    other = build_drafter(load_config(make_config(drafter={"draft_vocab_size": 64})), torch.device("cpu"))
    full = build_drafter(load_config(make_config()), torch.device("cpu"))
    for model in (other, full):
        with pytest.raises(ValueError, match="draft vocabulary"):
            check_same_draft_vocab(model, tmp_path / "reduced" / "model.safetensors")


def test_preflight_and_the_drafter_share_one_count_and_a_rewritten_dataset_is_counted_again(
    make_config, tiny_target, tmp_path, monkeypatch
):
    """`dflash train` runs the preflight then builds the drafter in one process: the data's supervised
    tokens are counted once (a pass over every token of a large dataset), and again only when the
    dataset's files change."""
    import shutil

    import datasets

    import trainer.drafter.vocab as dvm
    from trainer.drafter.model import build_drafter
    from trainer.preflight import run_preflight

    data = tmp_path / "ds"
    datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3, 4] * 20] * 6, "loss_mask": [[0, 1, 1, 1] * 20] * 6}
    ).save_to_disk(str(data))
    passes = []
    real = dvm.supervised_token_counts
    monkeypatch.setattr(dvm, "supervised_token_counts", lambda ds, v: passes.append(1) or real(ds, v))
    cfg = load_config(make_config(data={"path": str(data)}, drafter={"draft_vocab_size": 4}))
    report = run_preflight(cfg)
    d = build_drafter(cfg, torch.device("cpu"))
    assert len(passes) == 1, "preflight and the drafter's build counted the data separately"
    assert report.data["draft_vocab_coverage"] == 1.0 and _kept(d) >= {2, 3, 4}
    # the same folder rewritten with other tokens: counted again, and the mapping follows the data
    datasets.Dataset.from_dict(
        {"input_ids": [[1, 7, 8, 9] * 20] * 6, "loss_mask": [[0, 1, 1, 1] * 20] * 6}
    ).save_to_disk(str(tmp_path / "ds2"))
    shutil.rmtree(data)
    shutil.move(tmp_path / "ds2", data)
    d2 = build_drafter(cfg, torch.device("cpu"))
    assert len(passes) == 2 and _kept(d2) >= {7, 8, 9}


def _kept(drafter) -> set[int]:
    return set(torch.nonzero(drafter.t2d).flatten().tolist())


# ---------------------------------------------------------------- D-PACE
def _dpace_by_hand(ce: torch.Tensor, mask: torch.Tensor, block: int, alpha: float) -> torch.Tensor:
    """D-PACE by its definition: w_k = m_k * sum_{j>=k} m_j * prod_{i<=j} s_i, with s_i the smoothed
    confidence (1 - alpha) * exp(-ce_i) + alpha at supervised positions and 1 elsewhere."""
    out = torch.zeros_like(ce)
    for a in range(ce.numel() // block):
        s = [
            (1 - alpha) * np.exp(-float(ce[a * block + i])) + alpha if mask[a * block + i] else 1.0
            for i in range(block)
        ]
        for k in range(block):
            m = [float(mask[a * block + i]) for i in range(block)]
            total = sum(m[j] * float(np.prod(s[: j + 1])) for j in range(k, block))
            out[a * block + k] = m[k] * total
    return out


def test_dpace_weights_equal_the_formula():
    from speculators.losses import dpace_loss_decay

    g = torch.Generator().manual_seed(0)
    block, anchors, alpha = 4, 5, 0.5
    ce = torch.rand(1, block * anchors, generator=g) * 3
    mask = (torch.rand(1, block * anchors, generator=g) > 0.2).long()
    got = dpace_loss_decay(None, mask, block, alpha, elementwise_loss=ce)
    want = _dpace_by_hand(ce[0], mask[0], block, alpha)
    assert torch.allclose(got[0], want, rtol=1e-5, atol=1e-6), (got[0] - want).abs().max()


# ---------------------------------------------------------------- Muon + AdamW
def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3, bias=False))
    return m


def _steps(model, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(5, 8, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_muon_with_adamw_is_speculators_two_optimizers_as_one_and_resumes_exactly():
    """One optimizer: the 2-D weights get torch's Muon, biases and norms torch's AdamW, bit for bit as
    the two optimizers side by side (speculators' way); its one state dict reloads into a fresh one
    and the continued run is bit-identical to the uninterrupted one."""
    from trainer.training.muon import MuonWithAdamW

    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.0}
    muon = {"lr": 2e-2, "momentum": 0.95, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}

    def groups(m):
        mats = [p for p in m.parameters() if p.ndim == 2]
        rest = [p for p in m.parameters() if p.ndim != 2]
        return [{"params": rest, "muon": False}, {"params": mats, "muon": True, **muon}]

    a = _model()
    one = MuonWithAdamW(groups(a), **kw)
    _steps(a, one, 6)
    b = _model()
    gb = groups(b)
    two = [
        torch.optim.AdamW(gb[0]["params"], **kw),
        torch.optim.Muon(gb[1]["params"], **muon),
    ]

    class Both:
        def zero_grad(self):
            for o in two:
                o.zero_grad()

        def step(self):
            for o in two:
                o.step()

    _steps(b, Both(), 6)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    state = one.state_dict()
    kinds = {k for st in state["state"].values() for k in st}
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= kinds
    # resume: 3 steps, save, a fresh model + optimizer loads it, 3 more == 6 straight
    c = _model()
    oc = MuonWithAdamW(groups(c), **kw)
    _steps(c, oc, 3)
    saved_w = {k: v.clone() for k, v in c.state_dict().items()}
    saved_o = oc.state_dict()
    d = _model()
    d.load_state_dict(saved_w)
    od = MuonWithAdamW(groups(d), **kw)
    od.load_state_dict(saved_o)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # the first 3 batches of the straight run
        torch.randn(5, 8, generator=g)
    for _ in range(3):
        x = torch.randn(5, 8, generator=g)
        od.zero_grad()
        d(x).pow(2).mean().backward()
        od.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), d.parameters(), strict=True))


def test_muon_groups_follow_speculators_split_on_a_real_drafter(make_config):
    from trainer.drafter.model import build_drafter
    from trainer.training.state import make_optimizer

    cfg = load_config(make_config(train={"optimizer": "muon", "muon_lr": 0.02}))
    d = build_drafter(cfg, torch.device("cpu"))
    opt, sched = make_optimizer(d, cfg, zero=False)
    name = {id(p): n for n, p in d.named_parameters()}
    adamw, muon = ([name[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert "fc.weight" in muon and any("mlp.down_proj" in n for n in muon)
    assert all(d.get_parameter(n).ndim == 2 for n in muon)
    assert "norm.weight" in adamw and all(d.get_parameter(n).ndim == 1 for n in adamw)
    trainable = {n for n, p in d.named_parameters() if p.requires_grad}
    assert set(adamw) | set(muon) == trainable and not set(adamw) & set(muon)
    adam_lr, muon_lr = (g["lr"] for g in opt.param_groups)  # both under the one schedule
    assert muon_lr / adam_lr == pytest.approx(0.02 / cfg.train.lr) and sched.get_last_lr()[0] == adam_lr


# ---------------------------------------------------------------- the memory model
def test_the_memory_model_counts_the_draft_vocabulary_and_muons_state(make_config, tiny_target):
    """Against real tensors: the frozen heads' elements, and the optimizer state's elements after one
    step (Muon: one buffer per matrix element, AdamW: two per other element)."""
    from trainer.drafter.model import build_drafter
    from trainer.target.info import TargetInfo
    from trainer.training.state import make_optimizer

    cfg = load_config(make_config(drafter={"draft_vocab_size": 96}, train={"optimizer": "muon"}))
    shapes = TargetInfo.from_folder(tiny_target).shapes(cfg)
    d = build_drafter(cfg, torch.device("cpu"))
    frozen = sum(p.numel() for p in d.parameters() if not p.requires_grad)
    assert shapes.drafter_frozen == frozen
    assert shapes.drafter_matrix_params == sum(
        p.numel() for n, p in d.named_parameters() if p.requires_grad and p.ndim == 2
    )
    opt, _ = make_optimizer(d, cfg, zero=False)
    for p in d.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    held = sum(v.numel() for st in opt.state.values() for k, v in st.items() if k != "step")
    from trainer.layout.sizing import ASSUMPTIONS, per_device_bytes

    part = per_device_bytes(
        shapes,
        gpus_per_copy=1,
        data_parallel=1,
        tokens=64,
        anchors=4,
        block=4,
        device="cpu",
        optimizer="muon",
    )
    assert part["drafter_optimizer"] == held * 4, "fp32 state, every element counted once"
    full = per_device_bytes(
        shapes,
        gpus_per_copy=1,
        data_parallel=1,
        tokens=64,
        anchors=4,
        block=4,
        device="cpu",
        optimizer="adamw",
    )
    assert part["drafter_optimizer"] < full["drafter_optimizer"]
    assert (
        part["logits"] == 16 * 96 * ASSUMPTIONS["logit_bytes"]["eager"] * ASSUMPTIONS["logit_copies"]["eager"]
    )


def test_the_run_configs_defaults_are_muon_and_dpace_and_the_plan_follows_them():
    """speculators' DFlash default and this project's ablation (docs/train.md, the recipe): Muon + D-PACE;
    the memory model's recipe takes its optimizer from the run config, not from a literal of its own."""
    from trainer.config.train import TrainConfig
    from trainer.layout.recipe import Recipe

    train = TrainConfig()
    assert (train.optimizer, train.position_weights) == ("muon", "dpace")
    assert Recipe(draft_layers=1, n_aux=5, block=16, anchors=4, tokens=64).optimizer == train.optimizer
