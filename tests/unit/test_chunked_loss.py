"""train.loss_chunk_rows: the chunked loss equals speculators' unchunked forward (loss, gradients,
metrics) on a real drafter built by build_drafter, and never saves a [rows, vocab] tensor for the
backward (the unchunked forward does: the control)."""

from __future__ import annotations

import pytest
import torch

from trainer.config.run import load_config

T, ANCHORS, CHUNK = 64, 8, 5  # 8 anchors x block 4 = 32 query rows; chunks of 5 leave a ragged last one


def _inputs(d, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = d.config.transformer_layer_config.hidden_size
    vocab = d.lm_head.weight.shape[0]
    loss_mask = torch.ones(1, T, dtype=torch.long)
    loss_mask[:, :6] = 0  # a prompt
    loss_mask[:, 30:36] = 0  # the second document's prompt
    return {
        "hidden_states": torch.randn(1, T, len(d.target_layer_ids) * hidden, generator=g),
        "input_ids": torch.randint(3, vocab, (1, T), generator=g),
        "loss_mask": loss_mask,
        "verifier_last_hidden_states": torch.randn(1, T, hidden, generator=g),
        "document_ids": (torch.arange(T) >= 30).long().unsqueeze(0),
        "position_ids": torch.cat([torch.arange(30), torch.arange(T - 30)]).unsqueeze(0),
    }


def _run(module, params, inputs, loss_config, seed: int = 1, weights: str = "fixed-exp-decay"):
    for p in params:
        p.grad = None
    torch.manual_seed(seed)  # the anchors are drawn at random: the same draw on both sides
    _, loss, metrics = module(
        **inputs, loss_config=loss_config, gamma=4.0, max_anchors=ANCHORS, per_position_loss_weight=weights
    )
    loss.backward()
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, [p.grad.clone() for p in params]


@pytest.mark.parametrize(
    "loss, weights",
    [
        ("ce", "fixed-exp-decay"),
        ("kl_div", "fixed-exp-decay"),
        ('{"ce": 0.3, "kl_div": 0.7}', "fixed-exp-decay"),
        ("ce", "dpace"),
    ],
)
def test_chunked_loss_equals_the_unchunked_forward(make_config, loss, weights):
    from speculators.losses import resolve_loss_config

    from trainer.drafter.model import build_drafter
    from trainer.training.chunked_loss import ChunkedDraftLoss

    d = build_drafter(load_config(make_config(drafter={"block_size": 4})), torch.device("cpu"))
    params = [p for p in d.parameters() if p.requires_grad]
    inputs = _inputs(d)
    cfg = resolve_loss_config(loss, "eager")
    ref_loss, ref_metrics, ref_grads = _run(d, params, inputs, cfg, weights=weights)
    loss_c, metrics_c, grads_c = _run(ChunkedDraftLoss(d, CHUNK), params, inputs, cfg, weights=weights)
    assert torch.allclose(loss_c, ref_loss, rtol=1e-6, atol=0), (float(loss_c), float(ref_loss))
    for a, b in zip(grads_c, ref_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), float((a - b).abs().max())
    assert metrics_c.keys() == ref_metrics.keys()
    for k in ref_metrics:  # counts exactly, loss terms to rounding
        assert torch.allclose(metrics_c[k].float(), ref_metrics[k].float(), rtol=1e-6), k
    assert float(ref_metrics["full_acc_total"]) > 0, "no supervised row: the comparison would be empty"
    if weights != "fixed-exp-decay":  # the weights reached the loss: not the exp-decay one
        assert not torch.allclose(_run(d, params, inputs, cfg)[0], ref_loss)


class RecordingHead(torch.nn.Module):
    """A head that remembers the most rows it was applied to (forward and backward's recompute)."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head, self.most_rows = head, 0

    def forward(self, x):
        self.most_rows = max(self.most_rows, x.numel() // x.shape[-1])
        return self.head(x)


def test_no_vocabulary_wide_tensor_is_made_or_kept(make_config):
    """The heads never see more than CHUNK rows (forward, and the backward's recompute), and the graph
    saves no [rows, vocab] tensor for the backward; the unchunked forward does both (the control)."""
    from speculators.losses import resolve_loss_config

    from trainer.drafter.model import build_drafter
    from trainer.training.chunked_loss import ChunkedDraftLoss

    rows = ANCHORS * 4
    cfg = resolve_loss_config("ce", "eager")

    def measure(chunked: bool) -> tuple[int, int]:
        d = build_drafter(load_config(make_config(drafter={"block_size": 4})), torch.device("cpu"))
        vocab, inputs = d.lm_head.weight.shape[0], _inputs(d)
        d.lm_head, d.verifier_lm_head = RecordingHead(d.lm_head), RecordingHead(d.verifier_lm_head)
        module = ChunkedDraftLoss(d, CHUNK) if chunked else d
        saved = [0]

        def pack(t):
            if t.dim() >= 2 and t.shape[-1] == vocab:
                saved[0] = max(saved[0], t.numel() // vocab)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.manual_seed(1)
            _, loss, _ = module(**inputs, loss_config=cfg, gamma=4.0, max_anchors=ANCHORS)
        loss.backward()
        return max(d.lm_head.most_rows, d.verifier_lm_head.most_rows), saved[0]

    assert measure(chunked=False) >= (rows, rows), "the control: the unchunked forward holds [rows, vocab]"
    assert measure(chunked=True) == (CHUNK, 0), "the chunked loss made or kept vocabulary-wide rows"


def test_chunk_rows_below_one_are_refused(make_config):
    from trainer.drafter.model import build_drafter
    from trainer.training.chunked_loss import ChunkedDraftLoss

    d = build_drafter(load_config(make_config()), torch.device("cpu"))
    with pytest.raises(ValueError, match="at least 1"):
        ChunkedDraftLoss(d, 0)


def test_chunked_backbone_is_compiled_where_speculators_compiles(make_config, monkeypatch):
    """Issue #32 item 1: speculators compiles only `DFlashDraftModel.forward`, and only with CUDA
    visible; the chunked loss calls `_backbone_forward` itself, so it must make the same decision or
    flex attention runs unfused on CUDA (the whole score matrix). With CUDA made visible for the
    decision only (the compute stays on CPU, traced with backend="eager": the tracing is what decides
    whether flex attention is fused, inductor's code generation is not under test), the backbone is
    compiled, a flex-attention forward raises no "called without torch.compile" warning, and a second
    step reuses the graph. Without CUDA it is the plain method (the control: the warning fires)."""
    import warnings

    from speculators.losses import resolve_loss_config
    from torch._dynamo.utils import counters
    from torch.nn.attention import flex_attention as fa

    from trainer.drafter.model import build_drafter
    from trainer.training import chunked_loss as cl

    d = build_drafter(load_config(make_config(drafter={"block_size": 4})), torch.device("cpu"))
    d._attn_impl, d._create_mask_fn = "simple_flex_attention", fa.create_block_mask  # as on CUDA
    for layer in d.layers:
        layer.self_attn.config._attn_implementation = "simple_flex_attention"
    inputs, cfg = _inputs(d), resolve_loss_config("ce", "eager")

    def flex_warnings(module) -> list[str]:
        fa._WARNINGS_SHOWN.discard("flex_attention_performance")  # torch warns once per process
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            torch.manual_seed(1)
            module(**inputs, loss_config=cfg, max_anchors=ANCHORS)
        return [str(w.message) for w in caught if "without torch.compile" in str(w.message)]

    monkeypatch.setitem(cl.COMPILE_OPTIONS, "backend", "eager")
    torch._dynamo.reset()
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)  # the decision only
        compiled = cl.ChunkedDraftLoss(d, CHUNK)
    assert cl.is_compiled(compiled._backbone), "not compiled where speculators compiles"
    assert flex_warnings(compiled) == []
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0 and flex_warnings(compiled) == [] and counters["stats"]["unique_graphs"] == graphs

    plain = cl.ChunkedDraftLoss(d, CHUNK)  # CPU: speculators compiles nothing, nor do we
    assert not cl.is_compiled(plain._backbone)
    assert flex_warnings(plain), "the control: uncompiled flex attention warns"
