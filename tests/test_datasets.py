"""datasets_local: IDX parsing, every bad-input case, the two data paths, and the mirror download."""

import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

import datasets_local as dl
from datasets_local import MNISTError


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file written independently of the parser: magic, big-endian sizes, raw bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_split(root, n=7, labels=None, gz=False, prefix="t10k"):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8) if labels is None else labels
    for name, arr in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels)):
        data = idx_bytes(arr)
        (root / (name + (".gz" if gz else ""))).write_bytes(gzip.compress(data) if gz else data)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
def test_parses_raw_and_gzip(tmp_path, gz):
    images, labels = write_split(tmp_path, gz=gz)
    x, y = dl.load_split(tmp_path, "test")
    assert x.dtype == torch.uint8 and x.shape == (7, 28, 28)
    assert np.array_equal(x.numpy(), images) and np.array_equal(y.numpy(), labels)


def test_dataset_and_tensors_agree(tmp_path):
    write_split(tmp_path, n=11)
    ds = dl.MNIST(tmp_path, train=False)
    xs, ys = ds.tensors()
    assert len(ds) == 11 and xs.shape == (11, 1, 28, 28)
    for i in (0, 5, 10):
        image, label = ds[i]
        assert image.shape == (1, 28, 28) and image.dtype == torch.float32
        assert torch.equal(image, xs[i]) and label == int(ys[i])
    assert abs(float(((ds.images.float() / 255 - dl.MEAN) / dl.STD).mean()) - float(xs.mean())) < 1e-5


def test_normalize_is_the_usual_formula_to_the_bit_on_every_pixel_value():
    pixels = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16)
    assert torch.equal(dl.normalize(pixels), ((pixels.float() / 255.0 - dl.MEAN) / dl.STD).unsqueeze(1))
    assert dl.BACKGROUND == float(dl.normalize(pixels)[0, 0, 0, 0]) and pixels[0, 0, 1] == 1  # the input untouched


def test_transform_applied(tmp_path):
    write_split(tmp_path)
    ds = dl.MNIST(tmp_path, train=False, transform=lambda t: t * 0, target_transform=lambda y: y + 100)
    image, label = ds[0]
    assert float(image.abs().sum()) == 0 and label >= 100


def corrupt(path, how):
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:-10])
    elif how == "longer":
        path.write_bytes(data + b"\0\0")
    elif how == "magic":
        path.write_bytes(b"\0\0\x08\x05" + data[4:])
    elif how == "header":
        path.write_bytes(data[:6])


@pytest.mark.parametrize("how,words", [("truncated", "truncated"), ("longer", "longer than its header"),
                                       ("magic", "magic number"), ("header", "truncated")])
def test_bad_idx_files_name_file_problem_and_fix(tmp_path, how, words):
    write_split(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte"
    corrupt(path, how)
    with pytest.raises(MNISTError) as err:
        dl.load_split(tmp_path, "test")
    message = str(err.value)
    assert str(path) in message and words in message and "re-download" in message


def test_swapped_files_are_named(tmp_path):
    write_split(tmp_path)
    img, lab = tmp_path / "t10k-images-idx3-ubyte", tmp_path / "t10k-labels-idx1-ubyte"
    a, b = img.read_bytes(), lab.read_bytes()
    img.write_bytes(b), lab.write_bytes(a)
    with pytest.raises(MNISTError, match="swapped"):
        dl.load_split(tmp_path, "test")


def test_count_mismatch(tmp_path):
    write_split(tmp_path, n=5)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(4, np.uint8)))
    with pytest.raises(MNISTError, match="5 images but .* 4 labels"):
        dl.load_split(tmp_path, "test")


def test_corrupt_gzip(tmp_path):
    write_split(tmp_path, gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2:] = b"\xff" * (len(data) - len(data) // 2)
    path.write_bytes(bytes(data))
    with pytest.raises(MNISTError, match="corrupt gzip"):
        dl.load_split(tmp_path, "test")


def test_missing_dataset_without_download(tmp_path):
    with pytest.raises(MNISTError, match="not found.*download"):
        dl.load_split(tmp_path, "train")


def test_download_from_unreachable_mirror_is_one_clear_error(tmp_path):
    with pytest.raises(MNISTError) as err:
        dl.download(tmp_path / "root", mirror=str(tmp_path / "no-such-mirror"), quiet=True)
    assert "MNIST_MIRROR" in str(err.value) and "does not exist" in str(err.value)
    assert not any((tmp_path / "root").iterdir()), "a failed download must leave nothing behind"


def test_download_rejects_corrupted_mirror_file(tmp_path, mnist_dir):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name in dl.SHA256:
        (mirror / (name + ".gz")).write_bytes(gzip.compress((mnist_dir / name).read_bytes(), compresslevel=1))
    bad = bytearray((mnist_dir / "t10k-labels-idx1-ubyte").read_bytes())
    bad[100] ^= 1  # one flipped bit: a well-formed gzip of the wrong payload
    (mirror / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(bad)))
    root = tmp_path / "root"
    with pytest.raises(MNISTError, match="checksum mismatch"):
        dl.download(root, mirror=str(mirror), quiet=True)
    assert not (root / "t10k-labels-idx1-ubyte").exists()
    assert not [p for p in root.iterdir() if p.name.endswith(".part")]


def test_download_from_mirror_verifies_and_skips(mnist_dir, monkeypatch):
    mtimes = {p.name: p.stat().st_mtime_ns for p in mnist_dir.iterdir()}
    monkeypatch.setattr(dl, "fetch", lambda *a: pytest.fail("valid files must not be fetched again"))
    dl.download(mnist_dir, quiet=True)
    assert {p.name: p.stat().st_mtime_ns for p in mnist_dir.iterdir()} == mtimes
    for name, digest in dl.SHA256.items():
        assert hashlib.sha256((mnist_dir / name).read_bytes()).hexdigest() == digest


def test_a_split_loaded_with_download_checks_its_own_two_files_only(tmp_path, mnist_dir, monkeypatch):
    """Each file is checked (SHA-256) when its split is loaded, so a run that loads both checks each once, and parsed
    from the bytes checked: each file read once; a split whose files are here loads offline even where the other
    split's are missing, and that one names its file."""
    for name in dl.SPLITS["train"]:
        (tmp_path / name).symlink_to(mnist_dir / name)
    checked, local_copy, read, read_file = [], dl.local_copy, [], dl.read_file
    monkeypatch.setattr(dl, "local_copy", lambda root, name: checked.append(name) or local_copy(root, name))
    monkeypatch.setattr(dl, "read_file", lambda path: read.append(Path(path).name) or read_file(path))
    offline = str(tmp_path / "no-mirror-here")
    train = dl.MNIST(tmp_path, train=True, download=True, mirror=offline)
    assert sorted(checked) == sorted(read) == sorted(dl.SPLITS["train"])
    assert len(train) == 60_000 and torch.equal(train.images, dl.load_split(mnist_dir, "train")[0])
    with pytest.raises(MNISTError, match="t10k-images-idx3-ubyte.gz could not be fetched"):
        dl.MNIST(tmp_path, train=False, download=True, mirror=offline)


def test_real_mnist_label_counts(mnist_dir):
    # The counts listed in shared/data/mnist/README.md.
    _, y_train = dl.load_split(mnist_dir, "train")
    _, y_test = dl.load_split(mnist_dir, "test")
    assert torch.bincount(y_train).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert torch.bincount(y_test).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_download_from_a_url_mirror(tmp_path, mnist_dir):
    """The URL path of the downloader (as for the upstream mirrors), served here by a file:// URL."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name in dl.SHA256:
        (mirror / (name + ".gz")).write_bytes(gzip.compress((mnist_dir / name).read_bytes(), compresslevel=1))
    dl.download(tmp_path / "root", mirror=mirror.as_uri() + "/", quiet=True)
    assert all(hashlib.sha256((tmp_path / "root" / n).read_bytes()).hexdigest() == h for n, h in dl.SHA256.items())


def test_truncated_http_body_is_one_clear_error_and_leaves_nothing(tmp_path):
    """A real HTTP server on 127.0.0.1 that promises more bytes than it sends (a dropped connection):
    http.client raises IncompleteRead, which is not an OSError; it must end as the downloader's message."""
    import http.server
    import threading

    class Truncating(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(gzip.compress(b"\0" * 1000)[:50])  # then the connection closes

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Truncating)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(MNISTError) as err:
            dl.download(tmp_path / "root", mirror=f"http://127.0.0.1:{server.server_port}/", quiet=True)
    finally:
        server.shutdown()
    assert "IncompleteRead" in str(err.value) or "incomplete" in str(err.value).lower(), err.value
    assert "MNIST_MIRROR" in str(err.value)
    assert not any((tmp_path / "root").iterdir())


@pytest.mark.parametrize("damage", ["truncated gz", "wrong size"])
def test_a_damaged_local_file_offline_is_named_before_the_failed_fetch(tmp_path, mnist_dir, damage):
    """A damaged file in --data-dir with no network: the message says first what is wrong with that file, then that
    no fresh copy could be had, then the fix; the file itself is left as it was."""
    name = "train-images-idx3-ubyte"  # the first file download() wants
    good = (mnist_dir / name).read_bytes()
    if damage == "truncated gz":
        path, data = tmp_path / f"{name}.gz", gzip.compress(good[:100_000], compresslevel=1)[:5000]
    else:
        path, data = tmp_path / name, good[:-100]
    path.write_bytes(data)
    with pytest.raises(MNISTError) as err:
        dl.download(tmp_path, mirror=str(tmp_path / "no-mirror-here"), quiet=True)
    message = str(err.value)
    said = "5,000 bytes that are not a whole gzip file" if damage == "truncated gz" else "47,039,916 bytes where MNIST's has 47,040,016"
    assert message.startswith(f"{path} is damaged: ") and said in message, message
    assert message.index(said) < message.index("could not be fetched") < message.index("Fix: delete the damaged file")
    assert path.read_bytes() == data


def test_a_good_gz_in_the_folder_is_used_without_fetching(tmp_path, mnist_dir):
    for name in dl.SHA256:
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress((mnist_dir / name).read_bytes(), compresslevel=1))
    dl.download(tmp_path, mirror=str(tmp_path / "no-mirror-here"), quiet=True)  # nothing to fetch: no error
    x, y = dl.load_split(tmp_path, "test")
    assert x.shape == (10000, 28, 28) and y.shape == (10000,)
