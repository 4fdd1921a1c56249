"""MNIST read by hand from its IDX files: download with integrity checks, a Dataset, whole-split tensors.

The IDX format (http://yann.lecun.com/exdb/mnist/): a big-endian header of two zero bytes, a type
byte (0x08 = unsigned byte), a dimension count, then one uint32 size per dimension, then the data.
Labels have magic 2049 (one dimension), images 2051 (three dimensions: count, rows, columns).

    python datasets_local.py --root data/mnist            # download (or copy from MNIST_MIRROR) and verify
"""

import gzip
import hashlib
import http.client
import os
import sys
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from core.run.files import disk_full, fetch, free_bytes, why_full, write_atomic

# The mirrors torchvision uses, tried in order. MNIST_MIRROR (or mirror=) replaces them.
UPSTREAM_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
# SHA-256 of the decompressed payloads, which are canonical (a mirror may re-wrap the gzip).
SHA256 = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
SIZES = {"train-images-idx3-ubyte": 47_040_016, "train-labels-idx1-ubyte": 60_008, "t10k-images-idx3-ubyte": 7_840_016,
         "t10k-labels-idx1-ubyte": 10_008}  # bytes, decompressed: 16 or 8 header bytes + the payload
SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IDX_MAGIC = {1: 2049, 3: 2051}  # dimension count -> magic number
MEAN, STD = 0.1307, 0.3081  # of the training images, the usual MNIST normalization


class MNISTError(RuntimeError):
    """One readable message naming the file, the problem and the fix."""


def _fix_hint(path: Path) -> str:
    return f"Delete {path} and run again to re-download it (or set MNIST_MIRROR to a good copy)."


# ----------------------------------------------------------------------------- IDX parsing
def read_file(path: Path) -> bytearray:
    """The file's bytes, read into a bytearray that a parsed tensor can then share: a split's 47 MB are read once and
    never copied."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        del data[f.readinto(data):]  # a file cut short meanwhile: what was there, which the checks then refuse
    return data


def read_bytes(path: Path) -> bytearray | bytes:
    """The file's payload, gunzipped when it starts with the gzip magic bytes."""
    path = Path(path)
    if not path.is_file():
        raise MNISTError(f"{path}: file not found. Download it with download=True "
                         f"(python datasets_local.py --root {path.parent}).")
    data = read_file(path)
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise MNISTError(f"{path}: corrupt gzip data ({e}). {_fix_hint(path)}") from None
    return data


def parse_idx(data: bytes, name: str = "<bytes>", expect_ndim: int | None = None) -> np.ndarray:
    """Parse an unsigned-byte IDX payload into a numpy array, checking every header field."""
    if len(data) < 4:
        raise MNISTError(f"{name}: truncated, {len(data)} bytes is shorter than the IDX header. {_fix_hint(Path(name))}")
    zero, dtype_code, ndim = int.from_bytes(data[:2], "big"), data[2], data[3]
    magic = int.from_bytes(data[:4], "big")
    if zero != 0 or dtype_code != 0x08 or ndim not in IDX_MAGIC:
        raise MNISTError(f"{name}: wrong magic number {magic} (expected 2049 for labels or 2051 for images); "
                         f"not an MNIST IDX file. {_fix_hint(Path(name))}")
    if expect_ndim is not None and ndim != expect_ndim:
        raise MNISTError(f"{name}: magic number {magic}, expected {IDX_MAGIC[expect_ndim]}; "
                         f"the image and label files may be swapped. {_fix_hint(Path(name))}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise MNISTError(f"{name}: truncated inside the header. {_fix_hint(Path(name))}")
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape))
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "longer than its header says"
        raise MNISTError(f"{name}: {what}: header says shape {shape} ({expected} bytes), file has "
                         f"{len(data)} bytes. {_fix_hint(Path(name))}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def read_idx(path, expect_ndim: int | None = None) -> np.ndarray:
    return parse_idx(read_bytes(path), str(path), expect_ndim)


# ----------------------------------------------------------------------------- download
def _mirrors(mirror: str | None) -> tuple[str, ...]:
    mirror = mirror or os.environ.get("MNIST_MIRROR")
    return (mirror,) if mirror else UPSTREAM_MIRRORS


def local_copy(root: Path, name: str) -> tuple[bytearray | bytes | None, str | None]:
    """(the payload of a good copy in root, else None; what is wrong with the one that is there): the raw file or its
    .gz beside it."""
    problems = []
    for path in (root / name, root / (name + ".gz")):
        if not path.is_file():
            continue
        data = read_file(path)
        try:
            payload = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        except (OSError, EOFError, zlib.error) as e:
            problems.append(f"{path} is damaged: {len(data):,} bytes that are not a whole gzip file ({e})")
            continue
        digest = hashlib.sha256(payload).hexdigest()
        if digest == SHA256[name]:
            return payload, None
        size = (f"{len(payload):,} bytes where MNIST's has {SIZES[name]:,}" if len(payload) != SIZES[name]
                else f"the right size but sha256 {digest[:12]}..., expected {SHA256[name][:12]}...")
        problems.append(f"{path} is damaged: {'decompressed, ' if payload is not data else ''}{size}")
    return None, "; ".join(problems) or None


def download(root, mirror: str | None = None, quiet: bool = False, names=tuple(SHA256)) -> dict:
    """Fetch MNIST's files (`names`: all four) into `root` (decompressed, SHA-256 checked); skip those already
    valid, raw or as the .gz a mirror folder holds. Returns each file's checked payload, {name: bytes}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    payloads = {}
    for name in names:
        path = root / name
        payloads[name], problem = local_copy(root, name)
        if payloads[name] is not None:
            continue
        errors = []
        for source in _mirrors(mirror):
            try:
                payload = gzip.decompress(fetch(source, name + ".gz"))
            except (OSError, EOFError, zlib.error, ValueError, http.client.HTTPException) as e:  # URLError is an OSError; IncompleteRead is not
                errors.append(f"{source}: {e}")
                continue
            digest = hashlib.sha256(payload).hexdigest()
            if digest != SHA256[name]:
                errors.append(f"{source}: checksum mismatch (sha256 {digest[:12]}..., expected {SHA256[name][:12]}...)")
                continue
            if (problem := disk_full(lambda: write_atomic(path, payload), root)) is not None:
                raise MNISTError(f"no space left to write {path}: {len(payload):,} bytes needed, {free_bytes(root):,} free "
                                 f"({why_full(problem)}); nothing half-written was kept. Fix: free space, or give "
                                 f"--data-dir on a disk with more room")
            if not quiet:
                print(f"downloaded {name} from {source}", file=sys.stderr)
            payloads[name] = payload
            break
        else:
            found = f"{problem} (kept untouched); " if problem else ""
            remove = "delete the damaged file and " if problem else ""
            raise MNISTError(
                f"{found}a fresh copy of {name}.gz could not be fetched into {root}: " + "; ".join(errors) +
                f". Fix: {remove}connect to the internet, or set MNIST_MIRROR (or --mirror) to a folder or URL "
                "holding the four MNIST .gz files, e.g. MNIST_MIRROR=../shared/data/mnist.")
    return payloads


# ----------------------------------------------------------------------------- tensors and Dataset
def _find(root: Path, name: str) -> Path:
    """Prefer the raw file; accept its .gz beside it (as the shared mirror folder holds them)."""
    raw, gz = root / name, root / (name + ".gz")
    return raw if raw.exists() or not gz.exists() else gz


def load_split(root, split: str = "train", download_missing: bool = False, mirror: str | None = None):
    """(images uint8 [N, 28, 28], labels int64 [N]) of one split, parsed and cross-checked."""
    if split not in SPLITS:
        raise MNISTError(f"unknown split {split!r}; choose one of {sorted(SPLITS)}")
    root = Path(root)
    image_name, label_name = SPLITS[split]
    # with download, this split's two files (a run that loads both splits checks each file once), each parsed from
    # the bytes its SHA-256 was checked on: read once
    checked = download(root, mirror, names=SPLITS[split]) if download_missing else None
    if not checked and not (_find(root, image_name).exists() and _find(root, label_name).exists()):
        raise MNISTError(f"MNIST {split} split not found in {root}. Fix: pass download=True "
                         f"(or run `python datasets_local.py --root {root}`), with MNIST_MIRROR set when offline.")
    image_path, label_path = _find(root, image_name), _find(root, label_name)
    if checked:
        images = parse_idx(checked[image_name], str(image_path), expect_ndim=3)
        labels = parse_idx(checked[label_name], str(label_path), expect_ndim=1)
    else:
        images, labels = read_idx(image_path, expect_ndim=3), read_idx(label_path, expect_ndim=1)
    if images.shape[0] != labels.shape[0]:
        raise MNISTError(f"{image_path} holds {images.shape[0]} images but {label_path} holds "
                         f"{labels.shape[0]} labels; one of them is from another set. {_fix_hint(root)}")
    if images.shape[1:] != (28, 28):
        raise MNISTError(f"{image_path}: images are {images.shape[1]}x{images.shape[2]}, MNIST's are 28x28.")
    if labels.size and labels.max() > 9:
        raise MNISTError(f"{label_path}: label {labels.max()} is outside 0..9. {_fix_hint(label_path)}")
    # the images share the bytearray they were read into; a gunzipped payload is immutable bytes, copied
    return torch.from_numpy(images if images.flags.writeable else images.copy()), torch.from_numpy(labels.astype(np.int64))


def normalize(images_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 28, 28] -> float32 [..., 1, 28, 28], scaled to [0, 1] then standardized. In place on one new
    tensor: the same values as `(x / 255 - MEAN) / STD`, a quarter of its time on a whole split (no temporaries)."""
    return images_uint8.to(torch.float32, copy=True).div_(255.0).sub_(MEAN).div_(STD).unsqueeze(-3)


# The value of a black pixel after normalization: MNIST's background, every image's minimum. A constant, so
# that no training step reads the batch's minimum back from the device.
BACKGROUND = float(normalize(torch.zeros(1, 1, 1, dtype=torch.uint8)))


def random_shift(x: torch.Tensor, generator: torch.Generator, fill: float = BACKGROUND, pad: int = 2) -> torch.Tensor:
    """The augmentation LeNet-5 trains with: each image translated by up to `pad` pixels in each direction, filled
    with the background."""
    return shift(x, *shift_offsets(len(x), generator, pad).to(x.device), fill, pad)


def shift_offsets(n: int, generator: torch.Generator, pad: int = 2) -> torch.Tensor:
    """random_shift's draw for n images, (2, n): each image's window row and column, 0 to 2 pad."""
    return torch.randint(0, 2 * pad + 1, (2, n), generator=generator, device=generator.device)


def shift(x: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, fill: float = BACKGROUND, pad: int = 2) -> torch.Tensor:
    """Each image of x translated to the window (oy, ox) of its padded copy: (pad, pad) is the image itself."""
    return windows(x, fill, pad)[torch.arange(len(x), device=x.device), oy, ox].unsqueeze(1)


def windows(x: torch.Tensor, fill: float = BACKGROUND, pad: int = 2) -> torch.Tensor:
    """Every translation of the images x (n, 1, h, w) by up to `pad` pixels, as one view (n, 2 pad + 1, 2 pad + 1, h,
    w) of their copy padded with `fill`: [i, oy, ox] is image i through the window at row oy and column ox, [i, pad,
    pad] the image itself. Indexed by (images, rows, columns) it is a batch and its shifts in one gather, each row a
    contiguous run: in LeNet-5's step on a 2-core Xeon with AMX, a batch of 512 gathered then shifted by two views of
    windows (unfold) took 0.57 ms of 11.63, and this way nothing beyond the gather (docs/lenet.md)."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad), value=fill)[:, 0]
    image, row, column = padded.stride()
    return padded.as_strided((n, 2 * pad + 1, 2 * pad + 1, h, w), (image, row, column, row, column))


class MNIST(Dataset):
    """MNIST as a map-style Dataset: (image float32 1x28x28 normalized, label int)."""

    def __init__(self, root, train: bool = True, download: bool = False, transform=None,
                 target_transform=None, mirror: str | None = None):
        self.split = "train" if train else "test"
        self.images, self.labels = load_split(root, self.split, download, mirror)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image, label = normalize(self.images[index]), int(self.labels[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole split as (float32 [N, 1, 28, 28], int64 [N]): batch by slicing, no per-sample calls."""
        return normalize(self.images), self.labels.clone()


def build_parser():
    from core.run.flags import Folder, Parser, Source

    parser = Parser(description=__doc__, prog="datasets_local.py")
    parser.add_argument("--root", default="data/mnist", type=Folder(), help="folder for the decompressed IDX files "
                        "(default: data/mnist)")
    parser.add_argument("--mirror", default=None, type=Source(), help="URL or folder with the four .gz files "
                        "(default: MNIST_MIRROR, then upstream)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    try:
        download(args.root, args.mirror)
        for split in SPLITS:
            images, labels = load_split(args.root, split)
            print(f"{split}: {len(labels)} images, label counts {torch.bincount(labels, minlength=10).tolist()}")
    except MNISTError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
