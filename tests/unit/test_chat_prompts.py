"""`dflash prompts` (trainer/regenerate/chat_input.py) and the multi-turn rule (turns.py): each format
into prompt lines, empty rows and turns dropped and counted, a row ending on an assistant turn never
answered again (also where eval builds its prompt), bad input refused with its line named (exit 2),
parquet and save_to_disk input, and the converter light at import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.eval import prompts as P
from trainer.regenerate import turns
from trainer.regenerate.chat_input import PromptsError, convert


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(raw) for raw in path.read_text().splitlines()]


def test_each_format_into_messages_lines(tmp_path):
    sg = jsonl(
        tmp_path / "sg.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "a"},
                    {"from": "gpt", "value": "b"},
                    {"from": "human", "value": "c"},
                ]
            }
        ],
    )
    convert(sg, "sharegpt", tmp_path / "o1.jsonl")
    assert lines(tmp_path / "o1.jsonl") == [
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ]
        }
    ]
    uc = jsonl(
        tmp_path / "uc.jsonl",
        [{"data": ["q1", "a1", "q2", "a2"]}, {"messages": [{"role": "user", "content": "x"}]}],
    )
    rep = convert(uc, "ultrachat", tmp_path / "o2.jsonl")
    assert lines(tmp_path / "o2.jsonl")[0]["messages"][-1] == {"role": "user", "content": "q2"}
    assert rep["answers_to_regenerate"] == 3 and rep["multi_turn_rows"] == 1
    oa = jsonl(
        tmp_path / "oa.jsonl",
        [
            {
                "messages": [
                    {"role": "developer", "content": "sys"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                ]
            },
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            {"messages": [{"role": "user", "content": "t"}, {"role": "tool", "content": "r"}]},
        ],
    )
    rep = convert(oa, "messages", tmp_path / "o3.jsonl", thinking="on")
    assert lines(tmp_path / "o3.jsonl") == [
        {
            "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
            "thinking": "on",
        }
    ]
    assert set(rep["dropped"]) == {"non-text content", "unsupported role 'tool'"}
    pr = jsonl(
        tmp_path / "pr.jsonl",
        [{"instruction": "do", "input": "this"}, {"prompt": "  "}, {"question": "why", "thinking": False}],
    )
    rep = convert(pr, "prompt", tmp_path / "o4.jsonl")
    assert lines(tmp_path / "o4.jsonl") == [
        {"messages": [{"role": "user", "content": "do\n\nthis"}]},
        {"messages": [{"role": "user", "content": "why"}], "thinking": "off"},
    ]
    assert rep["dropped"]["empty row"]["examples"] == [f"{pr}:2"]


def test_empty_turns_joined_neighbours_trailing_answer_and_the_report(tmp_path, capsys):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "a"},
                {"from": "gpt", "value": " "},
                {"from": "human", "value": "b"},
                {"from": "gpt", "value": "c"},
            ]
        },
        {"conversations": []},
        {"conversations": [{"from": "gpt", "value": "only an answer"}]},
    ]
    src = jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "p.jsonl"
    assert main(["prompts", str(src), "--format", "sharegpt", "--out", str(out)]) == 0
    assert lines(out) == [{"messages": [{"role": "user", "content": "a\n\nb"}]}]
    rep = json.loads((tmp_path / "p.jsonl.report.json").read_text())
    assert rep["rows_read"] == 3 and rep["rows_kept"] == 1 and rep["rows_dropped"] == 2
    assert rep["dropped"] == {
        "empty row": {"count": 1, "examples": [f"{src}:2"]},
        "no user turn": {"count": 1, "examples": [f"{src}:3"]},
    }
    assert rep["turns"]["empty turns dropped"] == 1 and rep["turns"]["same-role turns joined"] == 1
    assert rep["turns"]["rows ending on an assistant turn (that turn is regenerated, not answered)"] == 1
    said = capsys.readouterr().out
    assert "1 of 3 rows kept" in said and "dropped 1: empty row" in said


@pytest.mark.parametrize(
    ("rows", "fmt", "match"),
    [
        (['{"conversations": ['], "sharegpt", r"in.jsonl:1: not valid JSON"),
        ([{"messages": []}, "[1, 2]"], "messages", r"in.jsonl:2: each row must be a JSON object"),
        ([{"conversations": []}], "messages", r"in.jsonl:1: --format messages needs a 'messages' field"),
        (
            [{"conversations": [{"from": "human", "value": 3}]}],
            "sharegpt",
            r"in.jsonl:1: turn 1 must be a string",
        ),
        ([{"conversations": "hi"}], "sharegpt", r"in.jsonl:1: the turns must be a list"),
        ([{"prompt": "a", "enable_thinking": "maybe"}], "prompt", r"in.jsonl:1: enable_thinking"),
        ([{"conversations": []}], "sharegpt", r"no row could be used \(1 read; dropped: empty row 1\)"),
    ],
)
def test_bad_input_is_refused_with_the_line_named_and_exit_2(tmp_path, capsys, rows, fmt, match):
    src = jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(PromptsError, match=match):
        convert(src, fmt, tmp_path / "out.jsonl")
    assert main(["prompts", str(src), "--format", fmt, "--out", str(tmp_path / "out.jsonl")]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_parquet_and_save_to_disk_input(tmp_path):
    import datasets

    rows = {"messages": [[{"role": "user", "content": "p"}, {"role": "assistant", "content": "q"}]]}
    ds = datasets.Dataset.from_dict(rows)
    ds.to_parquet(str(tmp_path / "in.parquet"))
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    convert(tmp_path / "in.parquet", "messages", tmp_path / "a.jsonl")
    assert lines(tmp_path / "a.jsonl") == [{"messages": [{"role": "user", "content": "p"}]}]
    with pytest.raises(PromptsError, match="splits test, train: choose one with --split"):
        convert(tmp_path / "dd", "messages", tmp_path / "b.jsonl")
    convert(tmp_path / "dd", "messages", tmp_path / "b.jsonl", split="test")
    assert lines(tmp_path / "b.jsonl") == lines(tmp_path / "a.jsonl")


def test_the_turn_rule_and_no_answer_to_an_answer():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "orig1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "orig2"},
    ]
    assert turns.round_messages(msgs, 0, []) == msgs[:2]
    assert turns.round_messages(msgs, 1, ["mine"]) == [
        *msgs[:2],
        {"role": "assistant", "content": "mine"},
        msgs[3],
    ]
    assert P.prompt_messages(msgs) == msgs[:4], "the trailing answer is not answered again"
    line = P.PromptLine(0, "messages", msgs)
    assert turns.rounds(line) == 2 and turns.rounds(P.PromptLine(0, "prompt", "x")) == 1

    class Tok:  # records what the chat template is given
        seen: list = []

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kw):
            self.seen.append((messages, kw))
            return [1, 2]

    tok = Tok()
    settings = P.TemplateSettings(chat_template=True, thinking="off", template_sha256="x")
    P.encode([line, P.PromptLine(1, "prompt", "hi", "on")], tok, settings)
    assert tok.seen[0] == (msgs[:4], {"enable_thinking": False})
    assert tok.seen[1] == ([{"role": "user", "content": "hi"}], {"enable_thinking": True})


def test_prompt_file_thinking_and_roles_are_checked(tmp_path):
    f = jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "a", "thinking": "on"}, {"messages": [{"role": "user", "content": "b"}]}],
    )
    got = P.read_prompt_file(f)
    assert [g.thinking for g in got] == ["on", None]
    for row, match in [
        ({"prompt": "a", "thinking": "yes"}, '"thinking" must be "on" or "off"'),
        ({"messages": [{"role": "assistant", "content": "b"}]}, "no user turn"),
        ({"messages": [{"role": "tool", "content": "b"}, {"role": "user", "content": "c"}]}, "not tool"),
    ]:
        with pytest.raises(P.PromptError, match=match):
            P.read_prompt_file(jsonl(tmp_path / "bad.jsonl", [row]))


def test_the_converter_is_light_at_import():
    code = (
        "import json, sys; import trainer.regenerate.chat_input, trainer.regenerate.turns; "
        "print(json.dumps([m for m in ('torch', 'transformers', 'datasets', 'pyarrow') if m in sys.modules]))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
