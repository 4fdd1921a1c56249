"""Every flag of every parser states what it allows, and a value outside it is one line naming the flag, exit 2,
no traceback, nothing on disk. The flags are read from the parsers themselves, so a flag added later without a
range fails here."""

import argparse
import math
import subprocess
import sys

import pytest

import datasets_local
import fabric_gpt
import fabric_lenet
from conftest import REPO
from core.gpt import hf_export, text_corpus
from core.host import warm_python
from core.run import flags
from gelu_ext import __main__ as gelu_main
from lab import bench, gpu_check, nanogpt_reference, report, sample, step_profile
from lab import stages as lab

PARSERS = {
    "fabric_lenet.py": lambda: flags.build_parser(fabric_lenet.Config, "", "fabric_lenet.py"),
    "fabric_gpt.py": lambda: flags.build_parser(fabric_gpt.Config, "", "fabric_gpt.py"),
    "python -m lab.sample": lambda: flags.build_parser(sample.Config, "", "python -m lab.sample"),
    "python -m lab.gpu_check": gpu_check.build_parser,
    "python -m lab.bench": bench.build_parser,
    "python -m lab.report": report.build_parser,
    "python -m lab": lab.build_parser,
    "datasets_local.py": datasets_local.build_parser,
    "python -m core.gpt.hf_export": hf_export.build_parser,
    "python -m lab.nanogpt_reference": nanogpt_reference.build_parser,
    "python -m lab.step_profile": step_profile.build_parser,
    "python -m core.gpt.text_corpus": text_corpus.build_parser,
    "python -m gelu_ext": gelu_main.build_parser,
}
COMMAND_AFTER = {bench.build_parser: "gpt", gelu_main.build_parser: "check"}
# Values a user may type by mistake; each flag must refuse them or turn them into a value it allows.
TRIED = ["", " ", "nan", "NaN", "inf", "-inf", "1e400", "-1", "-5", "-0.5", "1.5", "abc", "0x10", "1e3", "99999999999999999999",
         "/nonexistent/folder", "README.md", "/proc/x.md", "..", "a/b"]


def actions(parser: argparse.ArgumentParser, prefix=()):
    """(argv prefix, action) for every flag and positional, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from actions(sub, (*prefix, name))
            continue
        yield prefix, action


def every_flag():
    for script, build in PARSERS.items():
        for prefix, action in actions(build()):
            name = action.option_strings[0] if action.option_strings else action.dest
            yield pytest.param(script, build, prefix, action.dest, id=f"{script}:{' '.join(prefix)}:{name}")


def find(build, prefix, dest):
    return next(a for p, a in actions(build()) if p == prefix and a.dest == dest)


def argv_for(build, prefix, action, value) -> list:
    if build in COMMAND_AFTER and not prefix and action.option_strings:  # a command is required after the flags
        return [*_flag(prefix, action, value), COMMAND_AFTER[build]]
    return _flag(prefix, action, value)


def _flag(prefix, action, value) -> list:
    if not action.option_strings:  # a positional: the command itself, or flags passed on to a script
        return [*prefix, value] if action.nargs != "*" else [*prefix, "--", "--lr", value]
    if action.nargs == 0:  # an on/off flag given a value
        return [*prefix, f"{action.option_strings[0]}={value}"]
    return [*prefix, action.option_strings[0], value]


def refused(build, argv, capsys) -> str | None:
    """The one-line message when the parser refuses argv, None when it takes it."""
    try:
        {bench.build_parser: bench.parse_args, step_profile.build_parser: step_profile.parse_args}.get(
            build, lambda a: build().parse_args(a))(argv)
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2, (argv, e.code, err)
        assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        return err
    capsys.readouterr()
    return None


def tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("script,build,prefix,dest", list(every_flag()))
def test_every_flag_refuses_what_it_does_not_allow(script, build, prefix, dest, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("a file where a folder is expected\n")
    (tmp_path / "runs").mkdir()  # report.py reads an existing runs/
    before = tree(tmp_path)
    action = find(build, prefix, dest)
    name = action.option_strings[0] if action.option_strings else dest
    assert action.help and action.help.strip(), f"{script} {name} has no help"
    kind = action.type
    if action.nargs == 0:  # on/off: a value is always refused
        for value in ("yes", "", "1"):
            message = refused(build, argv_for(build, prefix, action, value), capsys)
            assert message and name in message, (name, value, message)
        return
    if action.nargs == "*":  # flags passed on to a script are checked by that script's parser, before any case runs
        message = refused(build, argv_for(build, prefix, action, "nan"), capsys)
        assert message and "--lr" in message
        return
    assert isinstance(kind, flags.Check), f"{script} {name} declares no range (give it a flags.Check as its type)"
    for value in TRIED:
        message = refused(build, argv_for(build, prefix, action, value), capsys)
        if message is None:  # taken: then it must be a value the flag can use
            accepted = kind(value)
            assert sane(kind, value, accepted), (name, value, accepted)
            continue
        # a positional value that starts with "-" is read as an unknown flag: the message names the value
        assert name in message or (not action.option_strings and value in message), (name, value, message)
    assert tree(tmp_path) == before, "parsing left something on disk"


def sane(kind, text, value) -> bool:
    """What no flag of this repository takes: a number that is not finite or negative, a fraction for an integer,
    an empty or blank value where something is required, a file where a folder goes."""
    if isinstance(kind, flags.Number):
        return math.isfinite(value) and value >= 0 and (kind.kind is float or isinstance(value, int))
    if isinstance(kind, flags.Choice):
        return value in kind.choices
    if isinstance(kind, (flags.Folder, flags.OutFile)):
        from pathlib import Path

        return (text == "" and kind.optional) or (text.strip() and not (Path(text).exists() and Path(text).is_file()
                                                                          and isinstance(kind, flags.Folder)))
    if isinstance(kind, flags.RunName):
        return "/" not in text and text not in (".", "..")
    if isinstance(kind, (flags.Resume, flags.Source)):
        from pathlib import Path

        return text in ("", "auto") or Path(text).exists()
    if isinstance(kind, flags.Existing):
        from pathlib import Path

        return (text == "" and kind.optional) or text in kind.names or (bool(text.strip()) and Path(text).exists())
    return isinstance(kind, (flags.Names, flags.Text))  # a prompt may be any text


@pytest.mark.parametrize("script,argv,words", [
    (fabric_gpt, ["--lr", "-1"], "--lr must be a finite number >= 0, got -1"),
    (fabric_gpt, ["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (fabric_gpt, ["--dropout", "2"], "--dropout must be a finite number >= 0 and < 1, got 2"),
    (fabric_gpt, ["--grad-clip", "nan"], "--grad-clip"),
    (fabric_gpt, ["--weight-decay", "-1"], "--weight-decay"),
    (fabric_gpt, ["--grad-clip", "-1"], "--grad-clip"),
    (fabric_gpt, ["--loss-scale-power", "-4", "--precision", "16-mixed"], "--loss-scale-power"),
    (fabric_gpt, ["--plan", "--tokens", "-5"], "--tokens"),
    (fabric_gpt, ["--plan", "--host-memory-gb", "-2"], "--host-memory-gb"),
    (fabric_gpt, ["--plan", "--device-memory-gb", "nan"], "--device-memory-gb"),
    (fabric_gpt, ["--out-dir", "README.md"], "--out-dir must be a folder"),
    (fabric_gpt, ["--seq-len", "1"], "--seq-len must be an integer >= 2, or 0"),  # a window with nothing to predict
    (fabric_lenet, ["--lr", "nan"], "--lr must be a finite number > 0"),
    (fabric_lenet, ["--lr", "inf"], "--lr"),
    (fabric_lenet, ["--weight-decay", "-1"], "--weight-decay"),
    (fabric_lenet, ["--weight-decay", "nan"], "--weight-decay"),
    (fabric_lenet, ["--node-timeout", "1e308"], "--node-timeout must be a finite number > 0 and <= 1e+06, got 1e308"),
    (bench, ["gpt", "--devices", "0"], "--devices must be an integer >= 1 (at most 2147483647), got 0"),
    (bench, ["gpt", "--", "--dropout", "2"], "--dropout"),
    (report, ["--runs", "no-runs-here"], "--runs must be an existing folder, got no-runs-here"),  # in tmp_path
    (report, ["--out", "/proc/x.md"], "--out must be a folder"),
])
def test_the_first_mistakes_end_in_one_line_before_any_work(script, argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("a file\n")
    monkeypatch.setattr(sys, "argv", [script.__name__])
    with pytest.raises(SystemExit) as exit_:
        script.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"error: {words}") and err.count("\n") == 1, err
    assert tree(tmp_path) == ["README.md"]  # no run folder, no report


def test_a_bad_value_from_the_shell_is_one_line_and_exit_2(tmp_path):
    """As a user runs it: the process exits 2 with one line and no traceback, and makes no run folder. In a real
    interpreter: a forked warm one would hide any warning the imports print, which the server printed long before."""
    proc = subprocess.run([warm_python.REAL, str(REPO / "fabric_gpt.py"), "--model", "tiny", "--accelerator", "cpu",
                           "--steps", "2", "--lr", "nan", "--out-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "error: --lr must be a finite number >= 0, got nan (see fabric_gpt.py --help)"
    assert not list(tmp_path.iterdir())


def test_a_config_built_in_python_is_checked_the_same_way():
    with pytest.raises(fabric_gpt.ConfigError, match=r"--dropout must be a finite number >= 0 and < 1, got 2.0"):
        fabric_gpt.validate(fabric_gpt.resolve(fabric_gpt.Config(dropout=2.0)))
    with pytest.raises(fabric_lenet.ConfigError, match=r"--lr must be a finite number > 0, got nan"):
        fabric_lenet.validate(fabric_lenet.Config(lr=float("nan")))


@pytest.mark.parametrize("script", list(PARSERS))
def test_help_is_grouped_and_each_flag_takes_at_most_two_lines(script, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    parsers = [PARSERS[script]()]
    parsers += [a.choices[c] for a in parsers[0]._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
    for parser in parsers:
        text = parser.format_help()
        entries, current = [], None
        for line in text.splitlines():
            if line.startswith("  -") or (line.startswith("  ") and not line.startswith("   ") and current is not None):
                current = [line]
                entries.append(current)
            elif line.startswith("    ") and current is not None:
                current.append(line)
            else:
                current = None if not line.startswith("  ") else current
        flagged = [e for e in entries if e[0].lstrip().startswith("-") and not e[0].lstrip().startswith("-h")]
        has_flags = any(a.option_strings and not isinstance(a, argparse._HelpAction) for a in parser._actions)
        assert bool(flagged) == has_flags, text
        for entry in flagged:
            assert len(entry) <= 2, "\n".join(entry)
    if script in ("fabric_gpt.py", "fabric_lenet.py"):
        groups = [g.title for g in parsers[0]._action_groups if g._group_actions]
        assert len(groups) >= 4, groups


def test_a_flag_declares_choices_or_bounds_never_both():
    """opt() refuses what it would otherwise drop in silence: bounds beside choices, bounds beside a check."""
    with pytest.raises(TypeError, match="exclude each other"):
        flags.opt("a", "a choice", ("a", "b"), min=0)
    with pytest.raises(TypeError, match="bounds"):
        flags.opt("x", "a folder", check=flags.Folder(), min=0)


def test_checking_a_folder_writes_nothing_anywhere(tmp_path, monkeypatch):
    """A folder is judged writable without a file made in it (parsing flags leaves no trace, even a passing one)."""
    import tempfile

    made = []
    monkeypatch.setattr(tempfile, "TemporaryFile", lambda *a, **k: made.append(k) or pytest.fail("a file was made"))
    monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: made.append(k) or pytest.fail("a file was made"))
    assert flags.Folder().ok(str(tmp_path)) and flags.Folder().ok(str(tmp_path / "new" / "deeper"))
    assert not flags.Folder().ok("/proc/fabric-lab") and not flags.Folder().ok("/sys/kernel")
    assert flags.OutFile().ok(str(tmp_path / "plan.json")) and not made

