"""The model-free parts of eval/regenerate: prompt files, template settings, report arithmetic,
batch planning and the stop rule, the side-by-side table, the CLI surface."""

from __future__ import annotations

import pytest

from trainer.eval.harness import PromptResult, finish_generation
from trainer.eval.prompts import PromptError, TemplateSettings, read_prompt_file, resolve_settings
from trainer.eval.report import aggregate, render_markdown, render_table
from trainer.regenerate import cut_response, plan_batches


def write(tmp_path, text: str):
    p = tmp_path / "p.jsonl"
    p.write_text(text)
    return p


def test_prompt_file_kinds_limit_and_errors(tmp_path):
    p = write(
        tmp_path,
        '{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "x"}]}\n{"input_ids": [1, 2]}\n'
        '{"text": "def f():"}\n',
    )
    lines = read_prompt_file(p)
    assert [(line.index, line.kind) for line in lines] == [
        (0, "prompt"),
        (1, "messages"),
        (2, "input_ids"),
        (3, "text"),
    ]
    assert len(read_prompt_file(p, limit=2)) == 2
    bad = {
        '{"prompt": ""}\n': "non-empty string",
        '{"input_ids": [1, -2]}\n': "non-negative ints",
        '{"messages": [{"role": "user"}]}\n': "{role, content}",
        '{"text": "x", "prompt": "y"}\n': "exactly one of",
        '{"text": " "}\n': "non-empty string",
        "[1, 2]\n": "exactly one of",
        "\n": "has no prompts",
        '{"prompt": "a"}\n{oops}\n': "p.jsonl:2: not valid JSON",
    }
    for text, message in bad.items():
        with pytest.raises(PromptError, match=message.replace("{", r"\{").replace("}", r"\}")):
            read_prompt_file(write(tmp_path, text))


def test_humaneval_is_a_named_set_of_164_completions(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trainer.eval.prompts import describe_prompts, encode

    lines = read_prompt_file("humaneval")
    assert len(lines) == 164 and {line.kind for line in lines} == {"text"}
    assert "def has_close_elements(" in lines[0].value and lines[0].value.rstrip().endswith('"""')
    info = describe_prompts("humaneval")
    assert info["name"] == "humaneval" and len(info["sha256"]) == 64
    assert len(read_prompt_file("humaneval", limit=5)) == 5
    # a completion prompt is tokenized as is, even where the chat template is on
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "def": 1, "f():": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}X {{ m['content'] }}{% endfor %}"
    on = resolve_settings(fast, None, None)
    completion = read_prompt_file(write(tmp_path, '{"text": "def f():"}\n'))
    assert on.chat_template and encode(completion, fast, on) == [[1, 2]]
    # a file of that name wins over the set
    monkeypatch.chdir(tmp_path)
    (tmp_path / "humaneval").write_text('{"prompt": "mine"}\n')
    assert [line.value for line in read_prompt_file("humaneval")] == ["mine"]
    assert describe_prompts("humaneval")["name"] == str(tmp_path / "humaneval")


def test_template_settings_resolve_and_differences():
    class Tok:
        chat_template = "{{ messages }}"

    s = resolve_settings(Tok(), None, "on")
    assert s.chat_template and s.thinking == "on" and len(s.template_sha256) == 64
    assert resolve_settings(None, None, None) == TemplateSettings(False, None, None)
    with pytest.raises(PromptError, match="no chat template"):
        resolve_settings(None, True, None)
    with pytest.raises(PromptError, match="needs the chat template"):
        resolve_settings(Tok(), False, "off")
    data = {"chat_template": True, "thinking": "off", "template_sha256": s.template_sha256}
    assert s.differences(data) == ["thinking: data 'off', here 'on'"]
    assert s.differences(None) == [] and s.differences(s.to_dict()) == []


def test_aggregate_tau_positions_histogram():
    a = PromptResult(4, [5, 6, 7, 8, 9], accepted=[3, 0], wall_s=1.0)
    b = PromptResult(4, [1, 2], accepted=[1], wall_s=1.0)
    agg = aggregate([a, b], block_size=4)
    assert agg["tau"] == pytest.approx((4 + 1 + 2) / 3) and agg["rounds"] == 3
    assert agg["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert agg["acceptance_histogram"] == {"0": 1, "1": 1, "2": 0, "3": 1}
    assert agg["new_tokens"] == 7 and agg["tokens_per_s"] == pytest.approx(3.5)
    assert a.tau == 2.5 and PromptResult(1, [2]).tau is None
    assert aggregate([PromptResult(1, [2])], 4)["tau"] is None


def test_finish_truncates_at_length_and_after_stop_token():
    assert finish_generation([1, 2, 3, 4], 3, set()) == ([1, 2, 3], "length")
    assert finish_generation([1, 9, 3, 9], 10, {9}) == ([1, 9], "stop_token")
    assert finish_generation([1, 2, 3, 9], 3, {9}) == ([1, 2, 3], "length")


def test_plan_batches_and_cut_response():
    prompts = [[1] * n for n in (5, 2, 9, 2, 5)]
    batches = plan_batches(prompts, 2)
    assert batches == [[1, 3], [0, 4], [2]]
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert cut_response([4, 5, 2, 7, 7], {2}) == ([4, 5, 2], True)
    assert cut_response([4, 5], {2}) == ([4, 5], False)


def test_markdown_and_table_render_the_figures():
    rep = {
        "label": "mine",
        "drafter": "d",
        "target": "t",
        "prompts": "p",
        "num_prompts": 1,
        "max_new_tokens": 4,
        "mode": "cached",
        "block_size": 3,
        "device": "cpu",
        "tau": 1.5,
        "rounds": 2,
        "new_tokens": 3,
        "tokens_per_s": 10.0,
        "wall_s": 1.0,
        "per_position_acceptance": [0.5, 0.0],
        "acceptance_histogram": {"0": 1, "1": 1, "2": 0},
        "warnings": ["w!"],
        "lossless": {"checked": 1, "matched": 1, "ok": True, "target_tokens_per_s": 20.0},
        "per_prompt": [
            {
                "index": 0,
                "prompt_tokens": 2,
                "new_tokens": 3,
                "rounds": 2,
                "tau": 1.5,
                "stopped": "length",
                "lossless": True,
            }
        ],
    }
    rep["trees"] = [
        {
            "budget": 16,
            "tau": 1.75,
            "tau_over_chain": 1.75 / 1.5,
            "target_tokens_per_round": 12.5,
            "per_depth_acceptance": [0.75, 0.0],
            "lossless": {"checked": 1, "matched": 1, "ok": True},
        }
    ]
    md = render_markdown(rep, "r.png")
    assert "## Tree verification (DDTree)" in md
    assert "| 16 | **1.750** | 1.17 | 12.5 | ok (1/1) | 0.75 | 0.00 |" in md
    assert "| chain | 1.500 | 1 | 3 | - | 0.50 | 0.00 |" in md
    assert "**1.500**" in md and "| accepted | 0.500 | 0.000 |" in md and "ok (1/1)" in md
    assert "> **warning**: w!" in md and "![acceptance](r.png)" in md
    table = render_table(
        [rep, {**rep, "label": "other", "tau": 1.25, "block_size": 2, "per_position_acceptance": [0.25]}]
    )
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["drafter", "tau", "tree16", "tok/s"] and "p2" in lines[0]
    assert lines[2].split() == ["mine", "1.500", "1.750", "10.0", "0.50", "0.00"]
    assert lines[3].split() == ["other", "1.250", "1.750", "10.0", "0.25", "-"]


def test_cli_parses_the_eval_export_and_regenerate_verbs():

    from trainer.cli import build_parser

    args = build_parser().parse_args(
        [
            "eval",
            "--drafter",
            "a",
            "--drafter",
            "b",
            "--target",
            "t",
            "--prompts",
            "p",
            "--out",
            "r.json",
            "--check-lossless",
            "all",
            "--thinking",
            "off",
        ]
    )
    assert (
        [str(d) for d in args.drafter] == ["a", "b"] and args.check_lossless == -1 and args.thinking == "off"
    )
    args = build_parser().parse_args(["regenerate", "--target", "t", "--prompts", "p", "--out", "o"])
    # no --backend: transformers, or the server backend when --server is given (cmd_regenerate resolves it)
    assert args.backend is None and args.server is None and args.max_new_tokens == 256
    assert args.chat_template is None and args.concurrency == 16 and args.retries == 4
    args = build_parser().parse_args(
        ["eval", "--drafter", "a", "--target", "t", "--prompts", "p", "--out", "r.json", "--engine", "both"]
    )
    assert args.engine == "both" and args.served_tolerance == 0.1
    args = build_parser().parse_args(["export", "--checkpoint", "c", "--out", "o", "--dtype", "bfloat16"])
    assert args.dtype == "bfloat16"


def reference(rows: list[list[float]], eps: float = 2.0**-7):
    """A GreedyReference from whole logit rows (bf16's eps by default): its greedy tokens, top 8."""
    from trainer.eval.lossless import TOP_K, GreedyReference

    order = [sorted(range(len(r)), key=lambda i: (-r[i], i))[:TOP_K] for r in rows]
    return GreedyReference(
        tokens=[o[0] for o in order],
        seconds=1.0,
        top_ids=order,
        top_logits=[[r[i] for i in o] for r, o in zip(rows, order)],
        scales=[max(abs(x) for x in r) for r in rows],
        dtype="bfloat16",
        eps=eps,
    )


def test_lossless_classification_of_crafted_logits():
    """tolerance = 8 x eps x max|logit|: with bf16's eps and a top logit of 20, 1.25 logits."""
    from trainer.eval.lossless import classify, summarise, tolerance

    flat = [0.0] * 12
    rows = [
        [20.0, 3.0, *flat[2:]],  # position 0: token 0, a clear choice
        [1.0, 20.0, 19.5, *flat[3:]],  # position 1: 1 over 2 by 0.5 (< 1.25): a near tie
        [1.0, 20.0, 17.0, *flat[3:]],  # position 2: 1 over 2 by 3.0 (> 1.25): no tie
        [0.0, 20.0, *[float(10 - i) for i in range(10)]],  # position 3: token 11 ranks 10th
    ]
    ref = reference(rows)
    assert ref.tokens == [0, 1, 1, 1] and tolerance(ref, 1) == pytest.approx(1.25)
    assert classify([0, 1, 1, 1], [0, 1, 1, 1], ref)["status"] == "exact"
    near = classify([0, 2, 5, 5], [0, 2, 5, 5], ref)  # parted at the tie: the rest is not compared
    assert near["status"] == "near-tie" and near["position"] == near["compared_tokens"] == 1
    assert (
        near["gap"] == pytest.approx(0.5) and near["reference_token"] == 1 and near["speculative_token"] == 2
    )
    far = classify([0, 1, 2, 1], [0, 1, 2, 1], ref)
    assert far["status"] == "mismatch" and far["gap"] == pytest.approx(3.0) and "> tolerance" in far["detail"]
    # a token below the reference's top 8: its gap is at least top-1 - top-8
    low = classify([0, 1, 1, 11], [0, 1, 1, 11], ref)
    assert (
        low["status"] == "mismatch" and low["gap"] == pytest.approx(20.0 - 4.0) and "top 8" in low["detail"]
    )
    # a committed token the verify forward did not choose fails even where the gap is a tie's
    lied = classify([0, 2, 5, 5], [0, 1, 5, 5], ref)
    assert lied["status"] == "mismatch" and "its verify forward chose 1" in lied["detail"]
    assert classify([0, 1, 1, 1], [0, 1], ref)["status"] == "mismatch"  # unrecorded choices
    assert classify([0, 1, 1, 1], None, ref)["status"] == "exact"  # not recorded at all: tokens alone
    assert classify([0, 1], [0, 1], ref)["status"] == "mismatch"  # one output ends early
    # in fp32 the same 0.5 gap is far above the tolerance (8 x 1.2e-7 x 20 ~ 2e-5)
    fp32 = reference(rows, eps=2.0**-23)
    assert classify([0, 2, 5, 5], [0, 2, 5, 5], fp32)["status"] == "mismatch"
    ll = summarise({0: classify([0, 1, 1, 1], None, ref), 1: near, 2: far}, ref)
    assert (ll["checked"], ll["matched"], len(ll["near_ties"]), ll["ok"]) == (3, 1, 1, False)
    assert [m["prompt"] for m in ll["mismatches"]] == [2] and ll["mismatches"][0]["first_difference_at"] == 2
    assert ll["near_ties"][0]["prompt"] == 1 and ll["tolerance"]["ulps"] == 8
    assert ll["compared_tokens"] == 4 + 1 + 2
    assert summarise({0: near}, ref)["ok"] is True and summarise({}, None)["ok"] is None
