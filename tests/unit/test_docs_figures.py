"""One source for the docs' layout figures: every figure a docs page states about a plan (TP sizes,
memory, disk, hours) is what `dflash plan` prints for it, recomputed here on the fixture configs.

A page marks each figure with an HTML comment (invisible once rendered):

- `<!-- plan: ARGS -->` on its own line before a fenced block: every line of the block is a line of
  `dflash plan ARGS`'s text (a line ending in `...` is a prefix of one; a line that is only `...` stands
  for lines left out; a `$ dflash ...` command and its continuation lines are skipped);
- `<!-- plan: ARGS => "TEXT" "TEXT" -->`: each TEXT, its `{json.path}` fields (`{inference.engine.
  tensor_parallel_size}`, list items by index: `{inference.engine.tried.1.per_gpu_gib}`) filled from
  `dflash plan ARGS --json`, appears in what the marker stands for: the next block or paragraph when the
  marker is on its own line, else the paragraph it sits in (whitespace compared loosely: prose wraps).

ARGS are `dflash plan` arguments (paths relative to the repository) with shorthands: a fixture target's
name (`qwen3-32b`: tests/fixtures/targets/NAME, or examples/NAME/target), a GPU kind (`A100-40GB`: --gpu)
and `xN` (--gpu-count N). A fenced block of plan output with no marker fails the test, so a figure
pasted from a terminal cannot go unchecked; `<!-- plan-checked: tests/...py::test_name -->` names the
test that checks a block built from a config made in a test instead.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from trainer.cli import build_parser
from trainer.layout.hardware import GPU_CATALOG
from trainer.layout.plan import make_plan
from trainer.layout.report import render_text

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
MARK = re.compile(r"<!-- plan: (.*?) -->", re.S)
CHECKED = re.compile(r"<!-- plan-checked: (\S+)::(\w+) -->")
FIELD = re.compile(r"\{([A-Za-z0-9_.]+)(:[^}]*)?\}")
REPORT_KEYS = {"target", "gpus", "layout", "memory", "why", "apply", "eval", "disk"}
REPORT_KEYS |= {"regen", "train", "cost", "budget", "offline"}


def plan_args(text: str) -> list[str]:
    out: list[str] = []
    for tok in shlex.split(text):
        fixture = ROOT / "tests" / "fixtures" / "targets" / tok
        example = ROOT / "examples" / tok / "target"
        if not tok.startswith("-") and fixture.is_dir():
            out += ["--target-config", str(fixture)]
        elif not tok.startswith("-") and example.is_dir():
            out += ["--target-config", str(example)]
        elif tok in GPU_CATALOG:
            out += ["--gpu", tok]
        elif re.fullmatch(r"x\d+", tok):
            out += ["--gpu-count", tok[1:]]
        elif not tok.startswith("-") and (ROOT / tok).exists():
            out.append(str(ROOT / tok))
        else:
            out.append(tok)
    return out


_plans: dict[str, tuple[dict[str, Any], list[str]]] = {}


def run(args: str) -> tuple[dict[str, Any], list[str]]:
    """(`dflash plan ARGS --json`'s object, its text lines), computed once per ARGS."""
    if args not in _plans:
        plan = make_plan(build_parser().parse_args(["plan", *plan_args(args)]))
        _plans[args] = plan, render_text(plan).splitlines()
    return _plans[args]


def field(plan: dict[str, Any], path: str) -> Any:
    value: Any = plan
    for part in path.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def fill(template: str, plan: dict[str, Any]) -> str:
    return FIELD.sub(lambda m: format(field(plan, m.group(1)), (m.group(2) or ":")[1:]), template)


def loose(text: str) -> str:
    return " ".join(text.split())


def scope(lines: list[str], at: int, start: int, end: int) -> tuple[str, list[str] | None]:
    """What a marker on line `at` (columns start..end) stands for: (its text, the fenced block's lines
    when it is one)."""
    line = lines[at]
    if line[:start].strip() == "" and line[end:].strip() == "":  # on its own line: what follows
        i = at + 1
        while i < len(lines) and not lines[i].strip():
            i += 1
        if i < len(lines) and lines[i].lstrip().startswith("```"):
            j = next(k for k in range(i + 1, len(lines)) if lines[k].lstrip().startswith("```"))
            return "\n".join(lines[i + 1 : j]), lines[i + 1 : j]
        j = i
        while j < len(lines) and lines[j].strip():
            j += 1
        return "\n".join(lines[i:j]), None
    i, j = at, at  # inside a paragraph: that paragraph
    while i > 0 and lines[i - 1].strip():
        i -= 1
    while j + 1 < len(lines) and lines[j + 1].strip():
        j += 1
    text = "\n".join(lines[i : j + 1])
    return MARK.sub("", text), None


def markers() -> list[tuple[str, int, str, list[str], str, list[str] | None]]:
    """(page, line number, args, templates, scope text, block lines) of every marker in docs/."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for at, line in enumerate(lines):
            for m in MARK.finditer(line):
                args, _, rest = m.group(1).partition("=>")
                templates = re.findall(r'"((?:[^"\\]|\\.)*)"', rest)
                text, block = scope(lines, at, m.start(), m.end())
                found.append(
                    (page.relative_to(ROOT).as_posix(), at + 1, args.strip(), templates, text, block)
                )
    return found


MARKERS = markers()


def test_the_pages_mark_their_figures():
    """The pages this issue fixed state their Qwen3-32B figures under markers (a guard against a
    marker removed with its check)."""
    pages = {m[0] for m in MARKERS}
    for page in ("docs/node-to-drafter.md", "docs/regenerate.md", "docs/evaluate.md", "docs/hardware.md"):
        assert page in pages, f"{page} has no <!-- plan: ... --> marker"
    assert len(MARKERS) >= 12


@pytest.mark.parametrize("page, line, args, templates, text, block", MARKERS, ids=lambda v: str(v)[:40])
def test_each_marked_figure_is_what_the_plan_prints(page, line, args, templates, text, block):
    plan, out = run(args)
    where = f"{page}:{line} (dflash plan {args})"
    if templates:
        for t in templates:
            want = fill(t, plan)
            assert loose(want) in loose(text), f"{where}: should say {want!r}"
        return
    assert block is not None, f"{where}: a marker without TEXT stands before a fenced block"
    printed = set(out)
    command = False
    for got in block:
        if got.startswith(("$ ", "dflash ")) or command:
            command = got.rstrip().endswith("\\")
            continue
        if got.strip() == "...":
            continue
        if got.endswith("..."):
            assert any(o.startswith(got[:-3]) for o in out), f"{where}: no printed line starts {got[:-3]!r}"
        else:
            assert got in printed, f"{where}: the plan does not print {got!r}; it prints:\n" + "\n".join(out)


def report_blocks(page: Path) -> list[tuple[int, bool]]:
    """(line of each fenced block holding a line of plan output, whether a marker stands before it)."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("```"):
            i += 1
            continue
        j = next(k for k in range(i + 1, len(lines)) if lines[k].lstrip().startswith("```"))
        body = lines[i + 1 : j]
        if any(
            (m := re.match(r"(\w+) +", b)) and len(m.group(0)) == 9 and m.group(1) in REPORT_KEYS
            for b in body
        ):
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            out.append((i + 1, k >= 0 and bool(MARK.fullmatch(lines[k].strip()) or CHECKED.search(lines[k]))))
        i = j + 1
    return out


def test_no_plan_output_on_a_page_goes_unchecked():
    unmarked = [
        f"{page.relative_to(ROOT)}:{line}"
        for page in PAGES
        for line, marked in report_blocks(page)
        if not marked
    ]
    assert not unmarked, f"plan output with no <!-- plan: ARGS --> before it: {unmarked}"


def test_a_block_checked_elsewhere_names_a_test_that_reads_the_page():
    for page in PAGES:
        for m in CHECKED.finditer(page.read_text()):
            path, name = ROOT / m.group(1), m.group(2)
            tree = ast.parse(path.read_text())
            fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
            assert fn is not None, f"{page}: {m.group(0)} names no test"
            assert page.name in ast.get_source_segment(path.read_text(), fn), (
                f"{name} does not read {page.name}"
            )


def test_the_checker_catches_a_stale_figure():
    """The check is not vacuous: a TP figure the plan does not give, and a changed block line, fail."""
    plan, out = run("qwen3-32b A100-40GB x8")
    assert fill("TP {inference.engine.tensor_parallel_size}", plan) == "TP 4"
    assert loose(fill("TP {inference.engine.tensor_parallel_size}", plan)) not in loose("the plan says TP 2")
    assert "layout   2 GPU(s) per target copy, data-parallel 4, train.shard full" not in out
    assert "layout   4 GPU(s) per target copy, data-parallel 2, train.shard full" in out
