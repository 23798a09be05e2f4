"""The layering rules of the package, checked on the code itself.

- The light side (the CLI, config, events, manifest, layout, monitor, S3, salvage bookkeeping) imports
  no torch, transformers, speculators, datasets or boto3: `dflash --help`, `monitor`, `plan`,
  `manifest` start in well under a second on a node whose GPU is busy. Each module is imported alone in
  a fresh interpreter, so one module cannot hide another's heavy import.
- No module imports another module's private (`_underscore`) names: what is shared gets a public name
  in one home.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "speculators", "datasets", "boto3")

LIGHT = (
    "trainer.cli",
    "trainer.cli.evaluate",
    "trainer.cli.gpu",
    "trainer.cli.node",
    "trainer.cli.run",
    "trainer.cli.salvage",
    "trainer.cli.watch",
    "trainer.config",
    "trainer.config.duration",
    "trainer.config.eval",
    "trainer.config.run",
    "trainer.config.schema",
    "trainer.config.section",
    "trainer.config.train",
    "trainer.config.user_yaml",
    "trainer.errors",
    "trainer.store",
    "trainer.store.checkpoint",
    "trainer.store.events",
    "trainer.store.fsutil",
    "trainer.store.manifest",
    "trainer.store.node_marker",
    "trainer.store.progress_file",
    "trainer.store.run_state",
    "trainer.target",
    "trainer.target.info",
    "trainer.target.tokenizer",
    "trainer.drafter",  # the package alone: its modules are the heavy side
    "trainer.sources",  # likewise
    "trainer.hub",
    "trainer.hub.card",
    "trainer.hub.pull",
    "trainer.hub.push",
    "trainer.preflight",
    "trainer.preflight.disk",
    "trainer.preflight.trackers",
    "trainer.preflight.vllm_request",
    "trainer.trackers",
    "trainer.trackers.clients",
    "trainer.trackers.follow",
    "trainer.trackers.sidecar",
    "trainer.run_init",
    "trainer.regenerate.chat_input",
    "trainer.eval.options",
    "trainer.eval.record",
    "trainer.eval.lossless",
    "trainer.training.evaluation",
    "trainer.eval.training_meta",
    "trainer.layout.disk",
    "trainer.layout.sandbox",
    "trainer.layout.gpus",
    "trainer.layout.hardware",
    "trainer.layout.hooked",
    "trainer.layout.inference",
    "trainer.layout.inputs",
    "trainer.layout.plan",
    "trainer.layout.recipe",
    "trainer.layout.report",
    "trainer.layout.server_tap",
    "trainer.layout.sizing",
    "trainer.layout.split",
    "trainer.monitor.alerts",
    "trainer.monitor.metrics",
    "trainer.monitor.runs",
    "trainer.monitor.server",
    "trainer.monitor.status",
    "trainer.monitor.summary",
    "trainer.training.budget",
    "trainer.s3.client",
    "trainer.s3.pull",
    "trainer.s3.push",
    "trainer.eval.benchmarks",
    "trainer.eval.prompts",
    "trainer.salvage.collect",
    "trainer.salvage.select",
    "trainer.salvage.facts",
    "trainer.salvage.loadable",
    "trainer.salvage.inventory",
    "trainer.salvage.notes",
    "trainer.salvage.stop",
    "trainer.salvage.verify",
    "trainer.demo.smollm",
)
# what the roles call on a bare node before anything else is installed: not even numpy
BARE = (
    "trainer.cli",
    "trainer.config",
    "trainer.config.duration",
    "trainer.config.eval",
    "trainer.config.run",
    "trainer.config.section",
    "trainer.config.train",
    "trainer.errors",
    "trainer.store",
    "trainer.store.events",
    "trainer.store.manifest",
    "trainer.target",
    "trainer.target.info",
    "trainer.target.tokenizer",
    "trainer.layout.gpus",
    "trainer.layout.hardware",
    "trainer.layout.hooked",
    "trainer.layout.inference",
    "trainer.layout.inputs",
    "trainer.layout.plan",
    "trainer.layout.recipe",
    "trainer.layout.report",
    "trainer.layout.server_tap",
    "trainer.layout.sizing",
    "trainer.layout.split",
    "trainer.cli.node",
    "trainer.cli.gpu",
)


@pytest.mark.parametrize("module", LIGHT)
def test_light_module_imports_no_heavy_stack(module):
    forbidden = (*HEAVY, "numpy") if module in BARE else HEAVY
    code = (
        f"import json, sys, {module} as m\n"
        "getattr(m, 'build_parser', lambda: None)()\n"  # the CLI: every verb's arguments registered
        f"print(json.dumps(sorted(x for x in {forbidden!r} if x in sys.modules)))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [], f"{module} imports a heavy module"


def _python_files() -> list[Path]:
    return sorted(p for top in ("trainer", "tests", "bench") for p in (ROOT / top).rglob("*.py"))


def _module_of(path: Path) -> str:
    if not path.is_relative_to(ROOT):
        return ""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path) -> list[str]:
    """`from trainer.x import _y`, and `m._y` where `m` names a trainer module imported here."""
    here = _module_of(path)
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    modules: dict[str, str] = {}  # local name -> trainer module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainer":
            for alias in node.names:
                if node.module != here and _private(alias.name):
                    found.append(f"{label}:{node.lineno}: from {node.module} import {alias.name}")
                if _is_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "trainer" and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _private(node.attr)
            and modules[node.value.id] != here
        ):
            found.append(f"{label}:{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_names():
    found = [hit for p in _python_files() for hit in private_imports(p)]
    assert found == [], "private names used outside their module:\n" + "\n".join(found)


def test_the_private_name_check_sees_both_forms(tmp_path):
    # the check itself must be able to fail: both spellings of a private import are found
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from trainer.store.manifest import _excluded\nimport trainer.store.fsutil as f\nf._hidden()\n"
    )
    hits = private_imports(probe)
    assert (
        len(hits) == 2
        and "trainer.store.manifest import _excluded" in hits[0]
        and "trainer.store.fsutil._hidden" in hits[1]
    )


def _trainer_imports(path: Path) -> set[str]:
    """The trainer modules `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainer":
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "trainer"]
        found.update(n for n in names if _is_module(n))
    return found


def test_eval_and_export_import_each_other_in_one_direction():
    # eval/run -> eval/served -> export -> eval/run was a circle (#34 item 8): the served report
    # (trainer.eval.served_report) now sits above export, which sits above the engine (trainer.eval.served)
    mods = {
        _module_of(p): p
        for p in sorted((ROOT / "trainer").rglob("*.py"))
        if _module_of(p).startswith("trainer.eval")
        or _module_of(p) in ("trainer.export", "trainer.vllm_engine")
    }
    graph = {m: _trainer_imports(p) & set(mods) - {m} for m, p in mods.items()}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    circles = sorted(m for m in graph if m in reach(m))
    assert "trainer.eval.run" in graph and graph["trainer.eval.served"]  # the check sees the modules
    assert circles == [], f"import circle through {circles}"
