"""The quality bench's prompt pools (trainer.demo.synth.stdlib_docstrings) and its second held-out set:
more and more varied training prompts than the 35-module pool, and HumanEval problems that are not the
training pool's siblings."""

import ast
import importlib.util
import sys

import pytest

from tests.conftest import REPO
from trainer.demo import synth


def test_the_wide_pool_is_larger_distinct_and_alternates_its_templates():
    narrow = synth.stdlib_docstrings(10_000)
    wide = synth.stdlib_docstrings(10_000, wide=True, templates=("explain", "write"))
    assert 395 <= len(narrow) <= 410  # 403 modules' docstrings; what other tests import can move it
    assert len(wide) > 3 * len(narrow) and len(set(wide)) == len(wide)
    assert wide[0].startswith("Explain what `") and wide[1].startswith("Write a short Python function")
    assert synth.stdlib_docstrings(5, wide=True) == synth.stdlib_docstrings(5, wide=True)  # seeded
    with pytest.raises(ValueError, match="use some of explain, write"):
        synth.stdlib_docstrings(5, templates=("poem",))


def test_the_completion_form_is_a_stub_that_parses_and_the_same_every_run():
    """`complete`: the object's stub (signature, the paragraph as its docstring) to complete, asked as the
    HumanEval set asks; every stub is Python (a default such as `<class 'str'>` or a function at an address,
    which would change the prompt from run to run, is written `...`)."""
    rows = synth.stdlib_docstrings(10_000, wide=True, templates=("explain", "write", "complete"))
    done = [r for r in rows if r.startswith("Complete this Python function.")]
    assert abs(len(done) - len(rows) / 3) <= 1  # every third, in turn
    for r in done:
        code = r.split("```python\n")[1].removesuffix("```")
        ast.parse(code)  # a SyntaxError fails the test, naming the stub
        assert code.startswith(("def ", "class ")) and " at 0x" not in code.splitlines()[0]
    assert "def atof(string, func=...):" in "".join(done)  # locale.atof's default is the float class


def test_the_second_held_out_set_is_humaneval_as_chat_prompts():
    spec = importlib.util.spec_from_file_location("quality_bench", REPO / "bench" / "quality_smollm2.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["quality_bench"] = bench
    spec.loader.exec_module(bench)
    rows = bench.humaneval_prompts(24)
    assert len(rows) == 24 and len({r["prompt"] for r in rows}) == 24
    assert all(
        r["prompt"].startswith("Complete this Python function.") and "def " in r["prompt"] for r in rows
    )
    docstrings = synth.stdlib_docstrings(10_000, wide=True, templates=("explain", "write"))
    assert not any(r["prompt"].split("```python\n")[1][:60] in d for r in rows for d in docstrings)
