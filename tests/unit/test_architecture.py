"""The layering rules of the package, checked on the code itself.

- The light side (the CLI, config, events, manifest, layout, monitor, S3, salvage bookkeeping) imports
  no torch, transformers, speculators, datasets or boto3: `dflash --help`, `monitor`, `plan`,
  `manifest` start in well under a second on a node whose GPU is busy. Each module is imported alone in
  a fresh interpreter, so one module cannot hide another's heavy import.
- No module imports another module's private (`_underscore`) names: what is shared gets a public name
  in one home.
- One home per concept, visible from the folders (docs/code-map.md): at most ten modules loose at
  `trainer/`, every folder a package; no import circle at module level, and none through imports
  inside functions beyond the ones kept on purpose; the light packages (config, store, target, hub,
  layout, preflight, cli) take nothing from `training/`, `sources/` or `monitor/` (the CLI's handlers,
  which import their implementation when they run, excepted). The graph is read with `ast`.
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
    "trainer.store.resumable",
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
    "trainer.store.progress_file",
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
# what a role runs with `python -m` before dflash (or anything beside the standard library) is installed:
# the python_env role's install watcher, on the synced source (roles/python_env/tasks/install.yml)
STDLIB_ONLY = ("trainer.store.progress_file",)


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


@pytest.mark.parametrize("module", STDLIB_ONLY)
def test_bare_python_module_runs_on_the_standard_library_alone(module):
    # `python -m MODULE --help` as a role runs it, the package's __init__ files on the way included, in
    # an interpreter without site-packages (-S): what a venv that is still being installed offers
    code = (
        "import json, runpy, sys\n"
        "before = set(sys.modules)\n"
        f"sys.argv = [{module!r}, '--help']\n"
        f"try:\n    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(json.dumps(sorted(new - set(sys.stdlib_module_names) - {'trainer'})))"
    )
    res = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [], f"{module} needs more than the stdlib"


# ---------------------------------------------------------------- the import graph: folders and circles

MAX_ROOT_MODULES = 10  # modules loose at trainer/ (its __init__.py not counted): the rest lives in folders
# the light packages: what `dflash --help`, plan, preflight and the bare-node steps stand on. They take
# nothing from the heavy folders: a piece of their own concept that lives there moves into them.
LIGHT_PACKAGES = (
    "trainer.config",
    "trainer.store",
    "trainer.target",
    "trainer.hub",
    "trainer.layout",
    "trainer.preflight",
    "trainer.cli",
)
HEAVY_FOLDERS = ("trainer.training", "trainer.sources", "trainer.monitor")
# checked at module level only: the CLI's handlers import their implementation when they run (that is
# the CLI's job); every other light package is checked inside its functions too
DISPATCHERS = ("trainer.cli",)
# (light module, heavy module) -> why: an import the rule above allows, each with its reason. Empty.
LIGHT_TO_HEAVY_ALLOWED: dict[tuple[str, str], str] = {}
# circles through imports inside functions (never at import time), each kept on purpose:
LAZY_CIRCLES_ALLOWED = (
    # `dflash salvage all` runs each salvage step through the CLI's own `main` (cli/salvage_all.py)
    {"trainer.cli", "trainer.cli.salvage", "trainer.cli.salvage_all"},
    # a salvage session's steps are recorded in NOTES.md and read back by the verify step
    {"trainer.salvage.notes", "trainer.salvage.session", "trainer.salvage.verify"},
)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _import_targets(node: ast.AST, root: Path) -> list[str]:
    """The modules an import statement binds: `from a.b import c` is a.b.c when that is a module, else
    a.b; `import a.b` is a.b."""

    def is_module(dotted: str) -> bool:
        base = root.joinpath(*dotted.split("."))
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()

    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainer":
        return [
            f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module
            for a in node.names
        ]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "trainer" and is_module(a.name)]
    return []


def _imports_of(tree: ast.Module, root: Path, lazy: bool) -> set[str]:
    """The trainer modules a module imports when it is imported (`lazy`: inside its functions too);
    never what an `if TYPE_CHECKING:` block names."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):  # never runs: only its else branch counts
            children = node.orelse
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not lazy:
            return  # runs when called, not when the module is imported
        else:
            found.update(_import_targets(node, root))
            children = list(ast.iter_child_nodes(node))
        for child in children:
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = ROOT, lazy: bool = False) -> dict[str, set[str]]:
    """module -> the trainer modules it imports (at module level; `lazy`: inside functions too)."""
    graph = {}
    for path in sorted((root / "trainer").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[module] = _imports_of(ast.parse(path.read_text(), filename=str(path)), root, lazy) - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan), each an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def root_modules(root: Path = ROOT) -> list[str]:
    return sorted(p.name for p in (root / "trainer").glob("*.py") if p.name != "__init__.py")


def light_to_heavy(graph: dict[str, set[str]], lazy: bool) -> list[str]:
    """`light -> heavy` for each import of a heavy folder by a light package's module."""

    def within(module: str, packages: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages)

    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if within(m, LIGHT_PACKAGES) and not (lazy and within(m, DISPATCHERS))
        for d in deps
        if within(d, HEAVY_FOLDERS) and (m, d) not in LIGHT_TO_HEAVY_ALLOWED
    )


def test_no_import_circle_at_module_level():
    graph = import_graph()
    assert "trainer.config.run" in graph and graph["trainer.config.run"]  # the check sees the imports
    assert circles(graph) == [], f"import circles: {[sorted(c) for c in circles(graph)]}"


def test_no_new_import_circle_through_functions():
    # a circle closed by an import inside a function does not fail at import time, but it still ties
    # the two concepts together: only the ones kept on purpose (LAZY_CIRCLES_ALLOWED) stay
    new = [
        sorted(c) for c in circles(import_graph(lazy=True)) if not any(c <= ok for ok in LAZY_CIRCLES_ALLOWED)
    ]
    assert new == [], f"import circles through imports inside functions: {new}"


def test_at_most_ten_modules_loose_at_the_package_root():
    loose = root_modules()
    assert len(loose) <= MAX_ROOT_MODULES, (
        f"{len(loose)} modules at trainer/: {loose}; put a concept's modules in its folder (docs/code-map.md)"
    )


def test_every_folder_of_the_package_is_a_package():
    # packages.find in pyproject.toml ships only folders with an __init__.py; amx_site/ is a site folder
    # put first on a vLLM CPU engine's PYTHONPATH (trainer/vllm_engine.py), not a package
    missing = sorted(
        str(d.relative_to(ROOT))
        for d in (ROOT / "trainer").rglob("*")
        if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").is_file() and d.name != "amx_site"
    )
    assert missing == [], f"folders of trainer/ without __init__.py: {missing}"


def test_light_packages_take_nothing_from_the_heavy_folders():
    found = light_to_heavy(import_graph(), lazy=False) + light_to_heavy(import_graph(lazy=True), lazy=True)
    assert sorted(set(found)) == [], (
        "light packages importing training/, sources/ or monitor/:\n" + "\n".join(sorted(set(found)))
    )


def test_the_graph_checks_can_fail(tmp_path):
    # each check above fails on a new violation: a circle (at module level, and through a function),
    # an eleventh loose module, a light package reaching into a heavy folder
    pkg = tmp_path / "trainer"
    for folder in ("config", "training"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "run.py").write_text("from trainer.training.budget import parse\n")
    (pkg / "training" / "budget.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trainer.a\n"
        "def parse():\n    from trainer.config import run\n"
    )
    for i in range(MAX_ROOT_MODULES + 1):
        (pkg / f"m{i}.py").write_text("import trainer.m0\n" if i == 1 else "")
    (pkg / "a.py").write_text("")
    (pkg / "m0.py").write_text("from trainer import m1\n")
    assert circles(import_graph(tmp_path)) == [{"trainer.m0", "trainer.m1"}]
    assert {"trainer.config.run", "trainer.training.budget"} in circles(import_graph(tmp_path, lazy=True))
    assert "trainer.a" not in import_graph(tmp_path, lazy=True)["trainer.training.budget"]  # TYPE_CHECKING
    assert len(root_modules(tmp_path)) == MAX_ROOT_MODULES + 2
    assert light_to_heavy(import_graph(tmp_path), lazy=False) == [
        "trainer.config.run -> trainer.training.budget"
    ]
