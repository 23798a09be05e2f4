"""Loop components on their own: the stall watchdog, the lr schedule, the drafter's frozen parts."""

import threading

import pytest
import torch

from trainer.config.run import load_config
from trainer.training.shutdown import StallWatchdog
from trainer.training.state import lr_lambda


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_stall_watchdog_warns_once_per_stall_and_rearms():
    clock, seen = FakeClock(), []
    wd = StallWatchdog(
        lambda step, waited, thr: seen.append((step, waited, thr)), factor=5, min_s=0.05, clock=clock
    )
    for step in range(1, 6):  # steady steps of 10 ms
        clock.now += 0.01
        wd.step_done(step)
    clock.now += 0.04
    assert not wd.check() and seen == [], "below max(min_s, 5 x median) is no stall"
    clock.now += 0.26  # step 6 hangs: 0.3 s > max(0.05, 5 x 0.01)
    assert wd.check() and not wd.check(), "one warning per stall"
    assert seen == [(6, pytest.approx(0.3), pytest.approx(0.05))]
    wd.step_done(6)
    clock.now += 0.02
    wd.step_done(7)
    assert not wd.check() and len(seen) == 1, "a normal step after the stall does not warn again"
    clock.now += 0.3
    assert wd.check() and len(seen) == 2 and seen[1][0] == 8, "the next stall warns again"


def test_stall_watchdog_thread_polls_by_itself():
    warned = threading.Event()
    wd = StallWatchdog(lambda *_: warned.set(), factor=5, min_s=0.0, poll_s=0.01).start()
    try:
        # no step ever completes: the first step's bound is 10 x min_s = 0 s, so the thread warns on
        # its own; the wait is a deadline on an observable event, not a fixed sleep
        assert warned.wait(timeout=30)
    finally:
        wd.stop()


def test_lr_schedule_warmup_then_cosine_to_floor(make_config):
    cfg = load_config(make_config(train={"max_steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1}))
    f = lr_lambda(cfg)
    assert f(0) == 0.1 and f(9) == 1.0  # linear warmup over 10 steps
    assert abs(f(10) - 1.0) < 1e-9 and f(55) < 1.0
    assert abs(f(100) - 0.1) < 1e-9  # cosine ends at the floor


def test_drafter_takes_the_targets_embedding_head_and_final_norm(make_config, tiny_target):
    from safetensors.torch import load_file

    from trainer.drafter.model import build_drafter

    cfg = load_config(make_config())
    d = build_drafter(cfg, torch.device("cpu"))
    target = load_file(str(tiny_target / "model.safetensors"))
    assert torch.equal(d.embed_tokens.weight, target["model.embed_tokens.weight"])
    assert torch.equal(d.verifier_lm_head.weight, target["lm_head.weight"])
    assert torch.equal(d.verifier_norm.weight, target["model.norm.weight"])
    frozen = {n for n, p in d.named_parameters(remove_duplicate=False) if not p.requires_grad}
    assert {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"} <= frozen
    assert d.lm_head.weight is d.verifier_lm_head.weight, "one frozen head serves both (sizing counts one)"
    assert not d.lm_head.weight.requires_grad
    assert d.fc.in_features == 2 * 64, "fc wired to every configured aux layer"
    assert d.config.transformer_layer_config._attn_implementation == "sdpa"


def test_bf16_heads_give_bit_identical_logits_and_grads_under_autocast(make_config):
    """cast_frozen_heads (CUDA, bf16 autocast) stores lm_head/verifier_lm_head in bf16: autocast casts
    them to bf16 for every matmul anyway, so logits and the gradient into the drafter are the same
    bits (checked with CPU autocast); the heads stay shared and frozen, the embedding stays fp32."""
    from trainer.drafter.model import build_drafter

    cfg = load_config(make_config())
    ref = build_drafter(cfg, torch.device("cpu"))
    half = build_drafter(cfg, torch.device("cpu"), head_dtype=torch.bfloat16)
    assert half.lm_head.weight is half.verifier_lm_head.weight and half.lm_head.weight.dtype == torch.bfloat16
    assert not half.lm_head.weight.requires_grad and half.embed_tokens.weight.dtype == torch.float32
    assert half.dtype == torch.float32, "the checkpoint's config.json keeps dtype float32"
    x = torch.randn(7, ref.config.transformer_layer_config.hidden_size)
    out = []
    for m in (ref, half):
        h = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m.lm_head(m.norm(h))
            target = m.verifier_lm_head(m.verifier_norm(x))
        logits.float().square().sum().backward()
        out.append((logits, target, h.grad))
    for a, b in zip(out[0], out[1], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_eval_device_maps_the_setting_to_the_childs_device_and_its_visible_gpu(monkeypatch):
    """eval.device: `trainer` is rank 0's own GPU as the node numbers it (through the trainer's
    CUDA_VISIBLE_DEVICES), `cuda:N` the node's GPU N whatever the trainer sees, `cpu` hides every GPU."""
    from trainer.training.evaluation import eval_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert eval_device("trainer", "cuda:0") == ("cuda", "4")
    assert eval_device("trainer", "cuda:1") == ("cuda", "5")
    assert eval_device("cuda:0", "cuda:0") == ("cuda", "0"), "a node GPU number, not the trainer's index"
    assert eval_device("cuda:7", "cuda:0") == ("cuda", "7")
    assert eval_device("trainer", "cpu") == ("cpu", "") and eval_device("cpu", "cuda:0") == ("cpu", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert eval_device("trainer", "cuda:2") == ("cuda", "2")


def test_eval_section_is_checked_before_any_model_loads(make_config, tmp_path):
    """`eval:` is off without prompts; a float cadence, a bad device or a prompt file that is not
    there is refused (ConfigError at load, the missing file by `dflash train` before the models load)."""
    from trainer.config.run import ConfigError
    from trainer.training.evaluation import eval_problem

    assert not load_config(make_config()).eval.enabled
    for bad, key in (({"every_steps": 2.0}, "every_steps"), ({"device": "gpu1"}, "device")):
        with pytest.raises(ConfigError, match=f"eval.{key}"):
            load_config(make_config(eval={"prompts": "p.jsonl", **bad}))
    cfg = load_config(make_config(eval={"prompts": "p.jsonl", "every_steps": 2}))
    assert cfg.eval.prompts == str(tmp_path / "p.jsonl"), "relative to the config's folder"
    assert "eval.prompts" in eval_problem(cfg) and "no such file" in eval_problem(cfg)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    assert eval_problem(cfg) is None
    assert eval_problem(load_config(make_config(eval={"prompts": "mt-bench"}))) is None, "a named set"
