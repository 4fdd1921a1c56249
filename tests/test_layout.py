"""The repository's layout as rules between folders: the design card's files at the top, what they stand on in
core/ by layer, the lab's tools in lab/, each floor importing only the floors below it (lazy imports and scripts
started by path count), no import circle anywhere, and every file saying what it holds."""

import ast
import itertools
import shutil
from pathlib import Path

import pytest

from conftest import REPO

# Floors, bottom up. A file belongs to the first unit its path starts with; it may import its own unit and the units
# of lower floors, never a unit beside it on its floor or above it.
FLOORS = [
    # the package's map (it imports nothing); the run's lifecycle and processes: flags, layout, the machine, ranks,
    # stops, files, checkpoints; the host's tools beside any run: a warm python, the extensions' compiler
    ["core/__init__.py", "core/run", "core/host"],
    ["core/gpt", "core/lenet"],  # GPT-2 and its parallelisms; LeNet-5's figures and CPU speed work
    ["core/plan"],  # the plan and its measurements
    ["datasets_local.py", "gelu_ext"],  # the hand-written parts the course asks for
    ["fabric_gpt.py", "fabric_lenet.py"],  # the scripts
    ["lab"],  # the lab's own tools: the lab, benchmarks, report, GPU check, sampling, nanoGPT's loop
]
TOP_LEVEL = {"Makefile", "README.md", "docs", "fabric_lenet.py", "fabric_gpt.py", "datasets_local.py", "gelu_ext",
             "tests", "requirements.txt", "gpt.sbatch", "core", "lab"}
LEAVE_OUT = {"tests", "runs", "report", "data", "build", "__pycache__"}


def sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & LEAVE_OUT
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def unit_of(rel: str) -> str | None:
    return next((u for floor in FLOORS for u in floor if rel == u or rel.startswith(u + "/")), None)


def floor_of(unit: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if unit in floor)


def module_file(root: Path, dotted: str) -> str | None:
    """The file (relative path) of a module this repository holds, or None for a library."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        for candidate in (Path(*parts[:n]).with_suffix(".py"), Path(*parts[:n]) / "__init__.py"):
            if (root / candidate).is_file():
                return str(candidate)
    return None


def dependencies(root: Path, path: Path) -> set[str]:
    """The repository's files that `path` imports (at any depth: lazy imports too) or starts by path (a string
    naming a .py file of the repository)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".py"):
            names = [node.value[:-3].replace("/", ".")]
        found |= {f for f in (module_file(root, n) for n in names) if f}
    return found - {str(path.relative_to(root))}


def graph(root: Path) -> dict[str, set[str]]:
    return {str(p.relative_to(root)): dependencies(root, p) for p in sources(root)}


def upward(root: Path) -> list[str]:
    """Every import that breaks the floors: a file outside every unit, or one importing a unit beside or above its own."""
    problems = []
    for file, deps in graph(root).items():
        unit = unit_of(file)
        if unit is None:
            problems.append(f"{file} is in no layer (FLOORS)")
            continue
        for dep in sorted(deps):
            other = unit_of(dep)
            if other and other != unit and floor_of(other) >= floor_of(unit):
                problems.append(f"{file} imports {dep}: {other} is {'beside' if floor_of(other) == floor_of(unit) else 'above'} {unit}")
    return problems


def circles(root: Path) -> list[list[str]]:
    """The import circles among files (strongly connected sets of more than one file)."""
    edges = graph(root)
    reach = {f: set() for f in edges}
    for f in edges:
        todo = list(edges[f])
        while todo:
            g = todo.pop()
            if g not in reach[f] and g in edges:
                reach[f].add(g)
                todo.extend(edges[g])
    return sorted({tuple(sorted({f} | {g for g in reach[f] if f in reach[g]})) for f in edges if f in reach[f]})


def test_every_file_sits_on_a_floor_and_imports_only_the_floors_below():
    assert not upward(REPO), upward(REPO)


def test_no_file_imports_itself_back_through_others():
    assert not circles(REPO), circles(REPO)


@pytest.mark.parametrize("place, imports, why", [
    ("core/run/placed_low.py", "from core.plan import perf_model", "above"),  # a plan module put in the ground floor
    ("core/gpt/placed_beside.py", "from core.lenet import figures", "beside"),  # GPT-2 reaching into LeNet-5's
    ("core/plan/starts_a_script.py", 'SCRIPT = "fabric_gpt.py"', "above"),  # a script started by path from below
    ("helpers.py", "import os", "no layer"),  # a new file at the top level
])
def test_the_rules_catch_a_module_in_the_wrong_layer(tmp_path, place, imports, why):
    """The checks above can fail: a copy of the tree with one module in the wrong place breaks them."""
    shutil.copytree(REPO, tmp_path / "repo", ignore=shutil.ignore_patterns(".*", *LEAVE_OUT - {"tests"}))
    (tmp_path / "repo" / place).write_text(f'"""A module in the wrong place."""\n{imports}\n')
    problems = upward(tmp_path / "repo")
    assert problems and all(p.startswith(place) and why in p for p in problems), problems


def test_a_circle_is_found(tmp_path):
    root = tmp_path / "repo"
    (root / "core" / "run").mkdir(parents=True)
    (root / "core" / "run" / "a.py").write_text("from core.run import b\n")
    (root / "core" / "run" / "b.py").write_text("import core.run.a\n")
    assert circles(root) == [("core/run/a.py", "core/run/b.py")]


def test_the_top_level_is_the_design_cards():
    """The card's entries, README.md, docs/, gpt.sbatch and the two packages; at most 4 .py files and 14 entries."""
    top = {p.name for p in REPO.iterdir() if not p.name.startswith(".") and p.name not in LEAVE_OUT - {"tests"}}
    assert top == TOP_LEVEL, (top - TOP_LEVEL, TOP_LEVEL - top)
    assert len(top) <= 14 and sum(name.endswith(".py") for name in top) <= 4


def test_the_parallel_layout_is_built_once_and_passed_down():
    """Built where the flags become a config (core/run/layout.py) and read as cfg.layout everywhere else: at most 5
    calls that build one (any name holding "layout") outside the tests."""
    calls = [f"{p.relative_to(REPO)}:{n.lineno}" for p in sources(REPO) for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Call) and "layout" in (getattr(n.func, "id", "") or getattr(n.func, "attr", "")).lower()
             and getattr(n.func, "attr", "") != "tight_layout"]
    assert len(calls) <= 5, calls


def test_the_lifecycle_is_the_ground_floor_the_scripts_share():
    """core/run/lifecycle.py builds on flags, ranks and hardware, and on the checkpoints, stops and step watches it
    runs; none of them imports it back; both scripts stand on it."""
    edges = graph(REPO)
    ground = {f"core/run/{m}.py" for m in ("flags", "ranks", "hardware", "checkpoints", "stops", "step_watch")}
    for below in ground | {"core/run/layout.py"}:
        assert "core/run/lifecycle.py" not in edges[below], below
    assert ground <= edges["core/run/lifecycle.py"]
    for script in ("fabric_lenet.py", "fabric_gpt.py"):
        assert {f"core/run/{m}.py" for m in ("flags", "ranks", "hardware", "lifecycle")} <= edges[script], script


def test_every_file_says_what_it_holds():
    """A module docstring on every file: the one idea a module holds, or what a script does and how to run it."""
    missing = [str(p.relative_to(REPO)) for p in sources(REPO) if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing


def test_no_two_modules_share_a_name_across_floors():
    """One name, one module: `strategies` is core/gpt/strategies.py wherever a reader meets it."""
    names = sorted(p.stem for p in sources(REPO) if p.name not in ("__init__.py", "__main__.py"))
    assert [n for n, group in itertools.groupby(names) if len(list(group)) > 1] == []
