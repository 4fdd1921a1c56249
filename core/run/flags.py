"""Command-line flags declared once, with what they allow: every script's parser is built from declarations
that state a flag's type and range (a number's bounds, its choices, a folder that must exist or be creatable),
and a value outside it ends in one line, `error: --lr must be a finite number > 0, got nan`, exit 2, before any
work is done or any folder is made.

A config dataclass declares each field with `opt(default, help, ...)`; `parse_config` turns it into argparse
flags in the groups the fields name. Plain argparse parsers (the lab's tools) use the same checks as
`type=`: `number(...)`, `choice(...)`, `folder(...)`, `out_file(...)`. tests/test_flags.py walks every flag of
every parser and fails on one that states no range.
"""

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path


class ConfigError(ValueError):
    """Settings that cannot work here, refused before any data or model is touched: one line with the fix."""


class Check:
    """An argparse `type=` that parses a string and refuses what the flag does not allow, saying what it allows."""

    allows = "a value"
    metavar = "VALUE"

    def __call__(self, text: str):
        if not self.ok(text):
            self.refuse(text)
        return text

    def ok(self, text: str) -> bool:
        raise NotImplementedError

    def refuse(self, text: str):
        raise argparse.ArgumentTypeError(f"must be {self.allows}, got {shown(text)}")


INT_MAX = 2**31 - 1


class Number(Check):
    """An int or a finite float within bounds; `zero` also allows 0 (a flag's "0: off / the default"), `auto` the word
    auto (the script measures the value on the machine)."""

    def __init__(self, kind=float, min=None, max=None, above=None, below=None, zero=False, auto=False):
        self.kind, self.min, self.max, self.above, self.below, self.zero = kind, min, max, above, below, zero
        self.auto = auto
        if kind is int and max is None:
            self.max = INT_MAX  # C's int: a count beyond it is a typo, and would overflow far from the flag
        self.metavar = "N" if kind is int else "X"
        shown_ = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731 - 1e+06, not 1000000.0
        bounds = [f">= {shown_(min)}" if min is not None else "", f"> {shown_(above)}" if above is not None else "",
                  f"<= {shown_(max)}" if max is not None else "", f"< {shown_(below)}" if below is not None else ""]
        self.allows = (("an integer" if kind is int else "a finite number") + " " + " and ".join(b for b in bounds if b)
                       + (", or 0" if zero else "") + (", or auto" if auto else "")).strip()
        self.allows += f" (at most {INT_MAX})" if kind is int and max is None else ""

    def __call__(self, text: str):
        if self.auto and text == "auto":
            return text
        try:
            value = int(text, 10) if self.kind is int else float(text)
        except (TypeError, ValueError):
            self.refuse(text)
        if self.kind is float and not math.isfinite(value):
            self.refuse(text)
        if self.zero and value == 0:
            return self.kind(0)
        if ((self.min is not None and value < self.min) or (self.max is not None and value > self.max)
                or (self.above is not None and value <= self.above) or (self.below is not None and value >= self.below)):
            self.refuse(text)
        return value


class Choice(Check):
    def __init__(self, choices):
        self.choices = tuple(choices)
        short = "{" + ",".join(c for c in self.choices if c) + "}"
        self.metavar = short if len(short) <= 16 else "NAME"
        self.allows = "one of " + ", ".join(c for c in self.choices if c) + (" (or nothing)" if "" in self.choices else "")

    def ok(self, text: str) -> bool:
        return text in self.choices


class Names(Check):
    """A comma-separated list of names from a fixed set (empty: all)."""

    metavar = "A,B"

    def __init__(self, names):
        self.names = tuple(names)
        self.allows = "a comma-separated list of " + ", ".join(self.names)

    def ok(self, text: str) -> bool:
        return not text or set(text.split(",")) <= set(self.names)


class Folder(Check):
    """A folder that exists, or (create=True) that can be made: not a file, under a writable folder.
    `optional`: the empty string means "not used"."""

    def __init__(self, create: bool = True, optional: bool = False):
        self.create, self.optional = create, optional
        self.metavar = "DIR"
        self.allows = ("a folder that exists or can be created" if create else "an existing folder") + \
            (" (or nothing)" if optional else "")

    def ok(self, text: str) -> bool:
        if text == "" and self.optional:
            return True
        path = Path(text).expanduser()
        if not text.strip() or (path.exists() and not path.is_dir()):
            return False
        if not path.exists():
            return self.create and writable_parent(path)
        return not self.create or writable(path)


class OutFile(Check):
    """A file path to write: not a folder, under a folder that exists or can be made and is writable."""

    def __init__(self, optional: bool = False):
        self.optional = optional
        self.metavar = "FILE"
        self.allows = "a file path that can be written" + (" (or nothing)" if optional else "")

    def ok(self, text: str) -> bool:
        path = Path(text).expanduser()
        return (text == "" and self.optional) or bool(text.strip()) and not path.is_dir() and writable_parent(path) \
            and (not path.exists() or os.access(path, os.W_OK))


class RunName(Check):
    allows = "a plain folder name (no '/': give the parent folder as --out-dir), or nothing for the default"
    metavar = "NAME"

    def ok(self, text: str) -> bool:
        return not text or (Path(text).name == text and text not in (".", "..") and bool(text.strip()))


class Resume(Check):
    allows = "auto or an existing checkpoint folder (ls runs/<run>/checkpoints lists a run's)"
    metavar = "auto|DIR"

    def ok(self, text: str) -> bool:
        return text in ("", "auto") or Path(text).expanduser().exists()


class Text(Check):
    """Any text (a prompt)."""

    allows, metavar = "any text", "TEXT"

    def ok(self, text: str) -> bool:
        return True


class Existing(Check):
    """An existing file or folder, or one of `names` (words the flag takes besides a path); empty when optional."""

    metavar = "PATH"

    def __init__(self, names=(), optional: bool = False):
        self.names, self.optional = tuple(names), optional
        self.allows = " or ".join([*self.names, "an existing file or folder"]) + (" (or nothing)" if optional else "")

    def ok(self, text: str) -> bool:
        return (text == "" and self.optional) or text in self.names or (bool(text.strip()) and Path(text).expanduser().exists())


class Source(Check):
    """Where files come from: an http(s)/file URL or an existing folder; empty for the default."""

    allows = "an http(s):// or file:// URL or an existing folder"
    metavar = "URL|DIR"

    def ok(self, text: str) -> bool:
        return not text or text.startswith(("http://", "https://", "file://")) or Path(text).expanduser().is_dir()


def shown(text: str) -> str:
    """A refused value as the user typed it; quoted where quotes show what it is (empty, spaces)."""
    return repr(text) if not text.strip() or text != text.strip() else text


def writable_parent(path: Path) -> bool:
    """The nearest folder above `path` that exists is a folder this user can write to."""
    for parent in path.absolute().parents:
        if parent.exists():
            return writable(parent)
    return False


PSEUDO_FILESYSTEMS = ("/proc", "/sys")  # the kernel's: nothing a run writes can be made there


def writable(folder: Path) -> bool:
    """A file could be made in `folder`, judged without making one (parsing flags leaves nothing on disk): this user
    may add entries to it (access(); root passes that everywhere), its filesystem is not mounted read-only, and it is
    not one of the kernel's pseudo filesystems, where access() says yes to root and creating a file still fails."""
    try:
        if not os.access(folder, os.W_OK | os.X_OK) or os.statvfs(folder).f_flag & os.ST_RDONLY:
            return False
        resolved = folder.resolve()
    except OSError:
        return False
    return not any(resolved == Path(p) or Path(p) in resolved.parents for p in PSEUDO_FILESYSTEMS)


def number(kind=float, **bounds) -> Number:
    return Number(kind, **bounds)


def choice(choices) -> Choice:
    return Choice(choices)


# ----------------------------------------------------------------------------- parsers
class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `error: --flag must be ..., got X` (exit 2) instead of a usage block."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if isinstance(kwargs.get("type"), Check) and "metavar" not in kwargs and args and args[0].startswith("-"):
            kwargs["metavar"] = kwargs["type"].metavar
        return super().add_argument(*args, **kwargs)

    def error(self, message: str):
        message = message.replace("argument ", "", 1) if message.startswith("argument ") else message
        if ": " in message and message.split(": ", 1)[0].startswith("-"):  # "--a/--no-a: msg" -> "--a msg"
            flag, rest = message.split(": ", 1)
            flag = flag.split("/")[0]
            if rest.startswith("ignored explicit argument"):
                rest = f"takes no value: it is {flag} or --no-{flag[2:]}, got {rest.split(' argument ', 1)[1]}"
            message = f"{flag} {rest}"
        message = message.replace("expected one argument", "expects a value")
        sys.stderr.write(f"error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Flags in a column of 30 characters, so that a flag's help takes at most two lines."""

    def __init__(self, prog, **kwargs):
        kwargs.setdefault("max_help_position", 30)
        kwargs.setdefault("width", max(100, min(140, _terminal_width())))
        super().__init__(prog, **kwargs)


    def _format_action_invocation(self, action):
        if isinstance(action, argparse.BooleanOptionalAction):  # --[no-]x: one column instead of two flags
            return "--[no-]" + action.option_strings[0][2:]
        return super()._format_action_invocation(action)


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((120, 24)).columns


NOT_RECORDED = object()  # `since`'s default: the flag is as old as the checkpoints


def opt(default, help: str, choices=None, *, group: str | None = None, check: Check | None = None,
        runtime: bool = False, since=NOT_RECORDED, **bounds):
    """A config field that becomes one flag: its help, its choices or bounds (`number`'s keywords), or a `check`;
    `group` starts a help section that the following fields join. What resume needs to know is declared here too:
    `runtime` flags change how a run executes, not what it computes (a checkpoint continues under new values);
    `since` is the value runs behaved as before the flag existed (their checkpoints do not record it)."""
    if default is None:  # an automatic boolean: --x / --no-x, neither leaves it to the script to decide (None)
        if bounds or choices is not None or check is not None:
            raise TypeError("opt(None): an automatic on/off flag takes no bounds, choices or check")
    elif choices is not None:
        if bounds:
            raise TypeError(f"opt(): choices {choices} and bounds {bounds} exclude each other; give one")
        check = Choice(choices)
    elif check is None and not isinstance(default, bool):
        check = Number(type(default), **bounds) if isinstance(default, (int, float)) else None
    elif bounds:
        raise TypeError(f"opt(): bounds {bounds} apply to numbers without a check; give the check its own")
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "check": check,
                                                         "group": group, "runtime": runtime, "since": since})


def runtime_fields(config) -> set[str]:
    """The fields declared runtime=True: a checkpoint continues under other values of these."""
    return {f.name for f in dataclasses.fields(config) if f.metadata.get("runtime")}


def recorded_since(config) -> dict:
    """{field: the value runs behaved as before it existed}, for the fields declared with `since`."""
    return {f.name: f.metadata["since"] for f in dataclasses.fields(config)
            if f.metadata.get("since", NOT_RECORDED) is not NOT_RECORDED}


def resume_flag():
    """--resume, the same in both scripts' configs."""
    return opt("", "auto: continue the run from its newest good checkpoint, or start it; or a checkpoint folder",
               check=Resume(), runtime=True)


def requeue_flag():
    """--requeue-signal, the same in both scripts' configs."""
    return opt("USR1", "in a SLURM job: the signal that saves, requeues the job and exits (none: off)",
               ("USR1", "USR2", "none"), runtime=True)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def build_parser(config_class, description: str, prog: str | None = None) -> Parser:
    """One flag per config field (--some-field) in the field's group, showing its default; --x/--no-x for booleans."""
    parser = Parser(description=description, prog=prog, usage="%(prog)s [flags]   (every flag below, by group)")
    group = parser
    for f in dataclasses.fields(config_class):
        if f.metadata.get("group"):
            group = parser.add_argument_group(f.metadata["group"])
        help_ = f.metadata.get("help", "")
        if f.type is bool or f.type == "bool" or f.default is None:  # None: on or off as the script decides
            group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_ + (" (default: on)" if f.default else " (default: auto)" if f.default is None
                                             else ""))
            continue
        check = f.metadata.get("check")
        if check is None:
            raise TypeError(f"{flag_name(f.name)} declares no allowed values: give opt() bounds, choices or a check")
        shown = f"{help_} (default: {f.default})" if f.default not in ("", 0) else help_
        named = [c for c in getattr(check, "choices", ()) if c != ""]
        if named and "one of" not in help_ and not all(c in help_ for c in named):  # unless the help names them
            shown += f"; one of: {', '.join(named)}"
        group.add_argument(flag_name(f.name), type=check, default=f.default, help=shown,
                           metavar=check.metavar if len(flag_name(f.name) + check.metavar) < 28 else "NAME")
    return parser


def parse_config(config_class, argv, description: str, prog: str | None = None):
    return config_class(**vars(build_parser(config_class, description, prog).parse_args(argv)))


def check_config(cfg) -> None:
    """The declared checks run again on a config built in Python rather than from flags (tests, bench, lab)."""
    for f in dataclasses.fields(cfg):
        check, value = f.metadata.get("check"), getattr(cfg, f.name)
        if check is None or isinstance(value, bool) or value is None:
            continue
        try:
            check(repr(value) if isinstance(value, float) else str(value))
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{flag_name(f.name)} {e}") from None
