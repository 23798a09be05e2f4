"""Hidden states in process: hooks equal transformers' own outputs, truncation changes nothing,
packed documents are isolated, the lm_head is never computed."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.sources.hooked import HookedTransformersSource, layerwise_assignment

AUX = [1, 3]


@pytest.fixture(scope="module")
def full_model(tiny_target):
    return AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()


def _inputs(T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (1, T), generator=g), torch.arange(T).unsqueeze(0)


def test_hooked_capture_equals_output_hidden_states_and_norm_input(tiny_target, full_model):
    src = HookedTransformersSource(tiny_target, AUX)
    ids, pos = _inputs()
    cap = src.capture(ids, pos)
    seen = {}
    h = full_model.model.norm.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        out = full_model(ids, position_ids=pos, output_hidden_states=True)
    h.remove()
    H = src.hidden_size
    for j, k in enumerate(AUX):
        torch.testing.assert_close(cap.aux[..., j * H : (j + 1) * H], out.hidden_states[k], rtol=0, atol=0)
    torch.testing.assert_close(cap.last, seen["x"], rtol=0, atol=0)
    # transformers' last hidden_states entry is post-norm: ours is its input
    torch.testing.assert_close(full_model.model.norm(cap.last), out.hidden_states[-1], rtol=0, atol=0)
    assert not torch.equal(cap.last, out.hidden_states[-1])


def test_truncated_forward_captures_the_same_states(tiny_target):
    ids, pos = _inputs(seed=1)
    full = HookedTransformersSource(tiny_target, AUX, need_last=True).capture(ids, pos)
    trunc_src = HookedTransformersSource(tiny_target, [1, 2], need_last=False)
    ran = []
    for i, layer in enumerate(trunc_src.model.layers):
        layer.register_forward_pre_hook(lambda *a, i=i: ran.append(i))
    trunc = trunc_src.capture(ids, pos)
    assert ran == [0, 1], "layers past the deepest aux layer must not run"
    ref = HookedTransformersSource(tiny_target, [1, 2]).capture(ids, pos)
    torch.testing.assert_close(trunc.aux, ref.aux, rtol=0, atol=0)
    torch.testing.assert_close(full.aux[..., :64], ref.aux[..., :64], rtol=0, atol=0)


def test_lm_head_and_final_norm_never_run(tiny_target):
    src = HookedTransformersSource(tiny_target, AUX)
    assert not hasattr(src.model, "lm_head"), "the base model is loaded: no lm_head in memory"
    fired = []
    src.model.norm.register_forward_hook(lambda *a: fired.append(1))
    src.capture(*_inputs())
    assert fired == []


def test_packed_documents_do_not_see_each_other(tiny_target):
    src = HookedTransformersSource(tiny_target, AUX)
    a, _ = _inputs(24, seed=2)
    b, _ = _inputs(16, seed=3)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(24), torch.arange(16)]).unsqueeze(0)
    cap = src.capture(packed, pos)
    ca = src.capture(a, torch.arange(24).unsqueeze(0))
    cb = src.capture(b, torch.arange(16).unsqueeze(0))
    torch.testing.assert_close(cap.aux[:, :24], ca.aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cap.aux[:, 24:], cb.aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cap.last[:, 24:], cb.last, rtol=1e-5, atol=1e-5)


def test_layerwise_split_assignment_and_equal_capture(tiny_target):
    assert layerwise_assignment(64, 2) == [0] * 32 + [1] * 32
    assert layerwise_assignment(5, 2) == [0, 0, 1, 1, 1]
    assert layerwise_assignment(4, 4) == [0, 1, 2, 3]
    ids, pos = _inputs(seed=4)
    one = HookedTransformersSource(tiny_target, AUX).capture(ids, pos)
    # two "devices" on CPU exercise the activation-moving hooks (real GPUs: see bench/docs)
    split = HookedTransformersSource(tiny_target, AUX, devices=[torch.device("cpu"), torch.device("cpu")])
    assert len(set(map(str, split.layer_devices))) == 1
    two = split.capture(ids, pos)
    torch.testing.assert_close(one.aux, two.aux, rtol=0, atol=0)


def test_aux_id_outside_depth_is_refused(tiny_target):
    with pytest.raises(ValueError, match="outside the target's depth"):
        HookedTransformersSource(tiny_target, [1, 9])


def test_the_drafter_shares_the_targets_embedding_only_when_it_is_equal(tiny_target, make_config):
    """train.share_target_embedding: the in-process target's embedding replaces the drafter's fp32
    copy (no parameter left, the same lookups, the target's aux-0 hook not fired by the drafter); a
    target whose embedding differs (loaded in fp16 here) is refused with the reason, the copy kept."""
    from trainer.config.run import load_config
    from trainer.drafter.model import build_drafter, share_target_embedding

    cfg = load_config(make_config(drafter={"aux_layer_ids": [1, 2], "mask_token_id": 3}), [])
    src = HookedTransformersSource(tiny_target, [0, 2])
    model = build_drafter(cfg, torch.device("cpu"))
    own = model.embed_tokens.weight.detach().clone()
    assert share_target_embedding(model, src.embedding_weight) is None
    assert model.embed_tokens.weight is src.embedding_weight
    assert "embed_tokens.weight" not in dict(model.named_parameters())
    ids = torch.tensor([[3, 7, 499]])
    out = model.embed_tokens(ids)
    assert out.dtype == torch.float32 and torch.equal(out, own[ids]) and not src._store

    fp16 = HookedTransformersSource(tiny_target, [2], dtype="float16")
    other = build_drafter(cfg, torch.device("cpu"))
    why = share_target_embedding(other, fp16.embedding_weight)
    assert why is not None and "differs from the drafter's copy from row 0" in why
    assert "embed_tokens.weight" in dict(other.named_parameters())
    assert share_target_embedding(other, None) == "the target is not in this process"
