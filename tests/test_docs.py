"""The README and docs/ as a newcomer reads them: every relative link resolves (file and #anchor), and every
`make` target the README names exists in the Makefile."""

import base64
import hashlib
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO
from core.host import installer

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def make_command(*args: str) -> list[str]:
    """The last command `make -n <args>` (or `make -s gpt-command`) would run, split as the shell splits it; run with
    none of the variables of a `make test` above it (make exports its command line's, ARGS among them)."""
    ours = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS", "RUNS", "RUN", "TEST_WORKERS")
    env = {k: v for k, v in os.environ.items() if k not in ours}
    out = subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout.strip().splitlines()[-1])


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
    assert len(PAGES) >= 8


def test_every_make_target_the_readme_names_exists():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    named = set(re.findall(r"`make ([a-z][\w-]*)", (REPO / "README.md").read_text()))
    assert named and not named - targets, named - targets


def test_readme_is_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_make_test_takes_a_worker_per_core_and_one_more_as_memory_allows(tmp_path):
    """One pytest worker more than the cores this process may use (`nproc`, whatever OMP_NUM_THREADS says, which
    `nproc` obeys: the suite's workers set it), at most one per 2.5 GiB of available memory, at least one: a machine
    of many cores and little memory would otherwise start more than it holds."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TEST_WORKERS")}
    env["OMP_NUM_THREADS"] = "1"
    cores, meminfo = len(os.sched_getaffinity(0)), tmp_path / "meminfo"
    for available_kib, workers in ((2**40, cores + 1), (5 * 2**20, min(cores + 1, 2)), (1000, 1)):
        meminfo.write_text(f"MemTotal:       {2**41} kB\nMemAvailable:   {available_kib} kB\n")
        out = subprocess.run(["make", "--no-print-directory", "-n", "test", f"MEMINFO={meminfo}"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)
        assert f" -n {workers} --dist worksteal" in out.stdout.strip().splitlines()[-1], (available_kib, out.stdout)


def test_the_suite_keeps_its_measurements_in_its_venv_and_never_reads_the_users(monkeypatch, tmp_path):
    """A warm `make test` takes the machine's measurements its last run made (.venv/test-measurements), as a user's
    second run does; never the user's cache, and a run outside the repository's .venv starts empty. The build log,
    which the suite's last line sums, stays the run's own."""
    import conftest

    cache = Path(os.environ["FABRIC_LAB_CACHE"]).resolve()
    assert cache != Path("~/.cache/fabric-lab").expanduser().resolve()
    assert Path(os.environ["FABRIC_LAB_BUILD_LOG"]).resolve().parent != cache
    venv = REPO / ".venv"
    monkeypatch.setattr(sys, "prefix", str(venv))
    kept = str(venv / "test-measurements") if os.access(venv, os.W_OK) else str(tmp_path / "measurements")
    assert conftest.measurement_cache(str(tmp_path)) == kept
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert conftest.measurement_cache(str(tmp_path)) == str(tmp_path / "measurements")


def test_make_setup_builds_beside_pip_not_after_it(tmp_path):
    """pip installs on one core: once torch, ninja and DeepSpeed are in (`.base`), the C++ GELU and DeepSpeed's ops
    build without waiting for the rest of requirements.txt, libaio and clang are unpacked without waiting for torch,
    and `make setup` runs its steps side by side (-j 3)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".base").touch()  # newer than requirements.txt and the GELU's sources; nothing else made yet
    for stamp in (".libaio", ".clang"):
        (venv / stamp).touch()
    builds = subprocess.run(["make", "--no-print-directory", "-n", f"VENV={venv}", f"{venv}/.gelu", f"{venv}/.ops"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert "load_cpp()" in builds.stdout and "build_cpu_ops()" in builds.stdout, builds.stdout + builds.stderr
    assert "-r requirements.txt" not in builds.stdout, builds.stdout
    setup = subprocess.run(["make", "--no-print-directory", "-n", f"VENV={venv}", "setup"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
    assert " -j 3 " in setup.stdout and "-r requirements.txt" in setup.stdout, setup.stdout + setup.stderr
    # in a new venv, before torch is in: libaio and clang (Debian's packages unpacked into its folder) need only the
    # folder, so they start beside torch's install rather than after it
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ".made").touch()
    unpack = subprocess.run(["make", "--no-print-directory", "-n", f"VENV={fresh}", f"{fresh}/.libaio",
                             f"{fresh}/.clang"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert "dpkg-deb" in unpack.stdout and not re.search(r"pip install|core\.host\.installer", unpack.stdout), \
        unpack.stdout + unpack.stderr


def one_module_wheel(folder: Path, name: str = "fabric_lab_probe", version: str = "1.0") -> None:
    """A wheel of one module, written by hand as a build backend would: what an index or a find-links folder holds."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": b"ANSWER = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    digest = lambda data: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record = [f"{path},sha256={digest(data)},{len(data)}" for path, data in files.items()] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
        wheel.writestr(f"{info}/RECORD", "\n".join(record) + "\n")


def test_make_setup_installs_with_uv_under_pips_settings_and_with_pip_where_uv_cannot(tmp_path):
    """`make setup` installs with uv, which reads no pip configuration: pip's settings reach it as flags (here a
    find-links folder and no index, the only place the wheel is), and a setting uv has no flag for (no-compile) sends
    the install to pip, saying so. Each installs into a venv of its own."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    one_module_wheel(wheels)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(wheels), "PIP_NO_INDEX": "1",
            "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    for case, extra in (("uv", {}), ("pip", {"PIP_NO_COMPILE": "1"})):
        target = tmp_path / case
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", target], check=True, timeout=60)
        done = subprocess.run([sys.executable, "-m", "core.host.installer", "--python", target / "bin" / "python",
                               "fabric_lab_probe"], cwd=REPO, env=env | extra, capture_output=True, text=True, timeout=120)
        said = done.stdout + done.stderr
        assert done.returncode == 0, said
        assert ("with pip" in said) == ("with pip: pip's setting 'no-compile' has no uv flag" in said) == (case == "pip"), \
            said
        probe = subprocess.run([target / "bin" / "python", "-c", "import fabric_lab_probe as p; print(p.ANSWER)"],
                               capture_output=True, text=True, timeout=60)
        assert probe.stdout.strip() == "42", probe.stderr


def test_pip_settings_reach_uv_as_pip_applies_them():
    """Its variables over the install section over the global one, another command's section ignored, several values
    split as pip.conf writes them; a setting of pip's own behaviour (its timeout) is not an install's."""
    listing = "\n".join(["global.index-url='https://a.example/simple'", "install.index-url='https://b.example/simple'",
                         "download.find-links='/not/for/install'", "global.extra-index-url='file:///x file:///y'",
                         ":env:.constraint='/c.txt'", "global.constraint='/old.txt'", "global.no-index='false'",
                         ":env:.default-timeout='180'"])
    flags, unknown = installer.uv_flags(installer.pip_settings(listing))
    assert unknown is None and flags == ["--index-strategy", "unsafe-best-match", "--constraints", "/c.txt",
                                         "--extra-index-url", "file:///x", "--extra-index-url", "file:///y",
                                         "--default-index", "https://b.example/simple"], flags
    assert installer.uv_flags({"no-binary": ":all:"}) == (None, "no-binary")
    assert installer.uv_flags(installer.pip_settings("global.find-links=/unquoted")) == (None, "find-links")


def test_every_target_writes_and_reads_the_one_runs_folder():
    """`make lenet RUNS=x` then `make report RUNS=x` (or tb, sample, export): the targets that write runs and those
    that read them take the same folder (lenet and gpt once wrote into runs/ whatever RUNS said), as one word even
    with a space or an apostrophe in it (a laptop's "My Drive": it split into several arguments)."""
    folder = "/tmp/Juliet's runs folder"
    for target in ["lenet", "gpt", "plan", "bench-lenet", "bench-gpt", "bench-text", "gelu-check", "bench-gelu", "lab",
                   "gpu-check", "report", "tb", "sample", "export"]:
        words = make_command("-n", target, f"RUNS={folder}", "RUN=r")
        pairs = set(zip(words, words[1:]))
        assert {("--out-dir", folder), ("--runs", folder), ("--logdir", folder), ("--out", f"{folder}/gelu")} & pairs \
            or words[-1] == f"{folder}/r", (target, words)


def test_a_prompt_reaches_the_sampler_as_typed():
    """`make sample PROMPT="..."` quotes the prompt for the shell: an apostrophe (Shakespeare's "'tis") ended the quote
    and the shell refused the command."""
    for prompt in ["ROMEO:", "'Tis the east, and Juliet's the sun", 'a "quoted" word; $(not run) `nor this`']:
        words = make_command("-n", "sample", "RUN=r", f"PROMPT={prompt}")
        assert words[words.index("--prompt") + 1] == prompt, words


def test_paths_with_spaces_and_apostrophes_reach_the_scripts_as_one_word():
    """A Makefile variable reaches its script as the one word typed: a path with a space or an apostrophe split into
    several arguments or ended the shell's quote. gpt-command prints the command quoted, as gpt.sbatch hands it to
    srun through `eval`."""
    runs, text, nvme = "my runs", "Juliet's lines.txt", "/tmp/a b; `x` $HOME"
    gpt = make_command("-n", "gpt", f"RUNS={runs}", f"TEXT={text}", f"NVME={nvme}", "RUN=a b")
    assert [gpt[gpt.index(f) + 1] for f in ("--out-dir", "--text", "--nvme-path", "--run-name")] == \
        [runs, text, nvme, "a b"]
    assert make_command("-s", "gpt-command", f"RUNS={runs}", f"TEXT={text}", "ARGS=--seed 3")[1:] == \
        ["fabric_gpt.py", "--out-dir", runs, "--text", text, "--seed", "3"]
    assert make_command("-n", "export", f"RUNS={runs}", "RUN=r 1")[-1] == f"{runs}/r 1"
