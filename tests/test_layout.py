"""The repository's layout: the modules beside the scripts never import a script (no circle runs back up), and
each names one idea."""

import ast

from conftest import REPO

SCRIPTS = {"fabric_lenet", "fabric_gpt", "bench", "lab", "gpu_check", "report"}
MODULES = ["accounting", "comm_counter", "datasets_local", "flags", "hardware", "hf_export", "perf_model", "ranks",
           "run_state",
           "strategies", "gelu_ext/__init__", "gelu_ext/__main__"]


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
    """run_state (the lifecycle) builds on flags, ranks and hardware; none of them imports it back."""
    for below in ("flags", "ranks", "hardware"):
        assert "run_state" not in imported(REPO / f"{below}.py"), below
    assert {"flags", "ranks", "hardware"} <= imported(REPO / "run_state.py")
    for script in ("fabric_lenet", "fabric_gpt"):
        assert {"flags", "ranks", "hardware", "run_state"} <= imported(REPO / f"{script}.py"), script
