"""The repository's layout: the modules beside the scripts never import a script (no circle runs back up), and
each names one idea."""

import ast

from conftest import REPO

SCRIPTS = {"fabric_lenet", "fabric_gpt", "sample", "bench", "lab", "gpu_check", "report"}
# every other file: one idea each (README's Layout), some also a command (datasets_local, text_corpus, hf_export, ...)
MODULES = ["accounting", "checkpoints", "comm_counter", "cpu_probe", "datasets_local", "extension_compiler", "flags",
           "gpt_figures", "gpt_model", "hardware", "hf_export", "layout", "lenet_figures", "nanogpt_reference", "perf_model",
           "ranks", "run_state", "step_watch", "stops", "strategies", "text_corpus", "warm_python", "gelu_ext/__init__", "gelu_ext/__main__"]


def test_every_file_is_a_script_or_a_module_listed_here():
    files = {str(p.relative_to(REPO).with_suffix("")) for p in [*REPO.glob("*.py"), *REPO.glob("gelu_ext/*.py")]}
    assert files == SCRIPTS | set(MODULES), (files - SCRIPTS - set(MODULES), SCRIPTS | set(MODULES) - files)


def imported(path) -> set[str]:
    """Every module an import statement names, at any depth (imports inside functions count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_below_the_scripts_imports_a_script():
    upward = {m: sorted(imported(REPO / f"{m}.py") & SCRIPTS) for m in MODULES}
    assert not any(upward.values()), upward


def test_the_lifecycle_is_the_ground_floor_the_scripts_share():
    """run_state (the lifecycle) builds on flags, ranks and hardware, and on the checkpoints, stops and step watches
    it runs; none of them imports it back."""
    for below in ("flags", "ranks", "hardware", "checkpoints", "stops", "step_watch", "layout"):
        assert "run_state" not in imported(REPO / f"{below}.py"), below
    assert {"flags", "ranks", "hardware", "checkpoints", "stops", "step_watch"} <= imported(REPO / "run_state.py")
    for script in ("fabric_lenet", "fabric_gpt"):
        assert {"flags", "ranks", "hardware", "run_state"} <= imported(REPO / f"{script}.py"), script


def test_every_file_says_what_it_holds():
    """A module docstring on every file: the one idea a module holds, or what a script does and how to run it."""
    missing = [m for m in sorted(SCRIPTS | set(MODULES)) if not ast.get_docstring(ast.parse((REPO / f"{m}.py").read_text()))]
    assert not missing, missing
