"""`make setup`'s installs: uv in pip's place, with pip's own settings; pip itself where uv cannot stand in.

    python -m core.host.installer [--python TARGET] <pip install arguments>   (-r requirements.txt, ...)

Why. pip unpacks one wheel after another and byte-compiles their 13,000 files one at a time, on one core: torch with
its CUDA libraries and DeepSpeed took 64-71 s of a new venv, requirements.txt's rest 34 s more. uv installs the
same versions side by side and compiles the bytecode on every core (docs/tests.md).

uv reads no pip.conf, so what `pip config list` reports (the configuration files and the PIP_* variables) is handed
to it as flags: indexes, find-links folders, constraints, certificates. A setting uv has no flag for sends the install
to pip, as does uv missing or failing, with one line saying why. Standard library only: it runs before anything else
is installed.
"""

import argparse
import ast
import shlex
import subprocess
import sys

# pip's settings uv takes as flags (pip's name: uv's flag); several values are separated by white space, as in pip.conf
SEVERAL = {"extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraints",
           "trusted-host": "--allow-insecure-host"}
ONE = {"index-url": "--default-index", "cert": "--cert"}
SWITCHES = {"no-index": ["--no-index"], "pre": ["--prerelease", "allow"]}
# pip's own behaviour (its output, its cache, its network patience, where its settings came from, already read, its
# guards for a system's Python, which a venv is not), nothing about what gets installed
PIP_ONLY = {"timeout", "default-timeout", "retries", "disable-pip-version-check", "no-input", "no-color", "progress-bar",
            "quiet", "verbose", "cache-dir", "no-cache-dir", "root-user-action", "require-virtualenv", "log",
            "config-file", "break-system-packages", "no-warn-script-location"}
# pip's precedence: its PIP_* variables over the install command's section over the global one
SECTIONS = {"global": 0, "install": 1, ":env:": 2}


def pip_settings(listing: str) -> dict:
    """`pip config list`'s lines (section.name='value') as {name: value}, each the one pip would apply to an install."""
    found = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if not sep or section not in SECTIONS:  # another command's section (download, wheel, ...)
            continue
        if name not in found or SECTIONS[section] >= found[name][0]:
            found[name] = (SECTIONS[section], readable(value))
    return {name: value for name, (_, value) in found.items()}


def readable(value: str):
    """A value as `pip config list` quotes it (Python's repr of a string), or None where it reads otherwise."""
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, str) else None


def uv_flags(settings: dict):
    """uv's flags for pip's settings, or (None, the setting) for one uv has no flag for or that could not be read."""
    flags = ["--index-strategy", "unsafe-best-match"]  # as pip: the newest version over every index, not the first's
    for name, value in sorted(settings.items()):
        if name in PIP_ONLY:
            continue
        if value is None:  # unreadable: what pip makes of it is unknown, so pip installs
            return None, name
        if name in SEVERAL:
            flags += [word for item in value.split() for word in (SEVERAL[name], item)]
        elif name in ONE:
            flags += [ONE[name], value]
        elif name in SWITCHES:
            flags += SWITCHES[name] if value.strip().lower() in ("1", "true", "yes", "on") else []
        else:
            return None, name
    return flags, None


def install(target: str, arguments: list) -> int:
    """Install `arguments` into `target`'s environment with uv where it can take pip's settings, else with pip."""
    pip, uv = [sys.executable, "-m", "pip"], [sys.executable, "-m", "uv"]
    listing = subprocess.run(pip + ["config", "list"], capture_output=True, text=True)
    flags, setting = uv_flags(pip_settings(listing.stdout))
    if subprocess.run(uv + ["--version"], capture_output=True).returncode != 0:
        reason = "uv is not installed"
    elif listing.returncode != 0:
        reason = "`pip config list` failed, so pip's settings are unknown"
    elif flags is None:
        reason = f"pip's setting {setting!r} has no uv flag"
    elif subprocess.run(uv + ["pip", "install", "--quiet", "--python", target, "--compile-bytecode"] + flags
                        + arguments).returncode != 0:
        reason = "uv failed (its message is above)"
    else:
        return 0
    print(f"note: installing {shlex.join(arguments)} with pip: {reason}", flush=True)
    elsewhere = ["--python", target] if target != sys.executable else []  # pip >= 22.3 only: not asked of make setup's
    return subprocess.run(pip + elsewhere + ["install", "--quiet"] + arguments).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
    args, arguments = parser.parse_known_args(argv)
    return install(args.python, arguments)


if __name__ == "__main__":
    sys.exit(main())
