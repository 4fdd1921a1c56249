"""fabric_lenet.py: the model, real training on real MNIST, 2-process DDP against 1 process, bad flags."""

import dataclasses
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import fabric_lenet
from conftest import FEW_TEST_IMAGES, REPO, read_summary, run_in_process, run_script, shared_dir
from core.lenet import cpu_speed
from core.lenet import figures as lenet_figures
from core.host import warm_python
from core.run import hardware
from datasets_local import BACKGROUND, random_shift
from fabric_lenet import Config, LeNet5, epoch_order

QUICK = ["--precision", "32-true", "--no-augment", "--no-tb-images", "--accelerator", "cpu"]


def test_lenet_shapes_and_parameter_count():
    model = LeNet5(Config())
    assert sum(p.numel() for p in model.parameters()) == 61_706  # LeCun et al. 1998, with 10 outputs
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_relu_pooled_first_is_the_same_function_and_gradient():
    """Pool-then-ReLU (the default's order, for speed) against LeNet-5's conv-ReLU-pool, same weights."""
    model = LeNet5(Config())
    reference = torch.nn.Sequential(model.features[0], torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                    model.features[3], torch.nn.ReLU(), torch.nn.MaxPool2d(2), model.classifier)
    x = torch.randn(16, 1, 28, 28)
    grads = []
    for net in (model, reference):
        net.zero_grad()
        out = net(x)
        out.square().sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


@pytest.mark.parametrize("channels_last", [False, True])
def test_zero_padded_channels_are_the_same_model(channels_last):
    """conv1's 6 channels computed as 8 (the default, for the CPU's max-pool kernel): the same parameters
    and state_dict, and the same outputs and parameter gradients as the plain LeNet-5, in both layouts."""
    plain, padded = LeNet5(Config(pad_channels=0)), LeNet5(Config())  # padded: built for channels-last
    padded.load_state_dict(plain.state_dict())  # same names and shapes, or this raises
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(32, 1, 28, 28).contiguous(memory_format=fmt)
    results = []
    for net in (plain, padded):
        net = net.to(memory_format=fmt)
        out = net(x)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad for p in net.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert padded.features[0](x).shape[1] == 8 and plain.features[0](x).shape[1] == 6
    assert LeNet5(Config(channels_last=False)).features[0](x).shape[1] == 6  # no padding in NCHW


def test_tensorboard_images_show_the_real_channels_only(tmp_path):
    """log_images (run each epoch when --tb-images is on): the feature maps of conv1 show its 6 channels, not the
    8 it is computed in; also the confusion matrix, the misclassified digits evaluate() found and weight
    histograms are written."""
    from lightning.fabric import Fabric
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from core.lenet.figures import log_images
    from fabric_lenet import evaluate

    model = LeNet5(Config())
    x, y = torch.randn(40, 1, 28, 28), torch.randint(0, 10, (40,))
    result = evaluate(Fabric(accelerator="cpu", devices=1), model, (x, y), batch=16)
    with torch.no_grad():
        assert result["misclassified"] == (model(x).argmax(1) != y).nonzero().flatten().tolist()
    writer = SummaryWriter(tmp_path)
    log_images(writer, model, result, (x, y), step=1)
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0}).Reload()
    assert {"test/confusion_matrix", "test/misclassified", "features/conv1", "features/conv2"} <= set(events.Tags()["images"])
    assert "weights/features.0.weight" in events.Tags()["histograms"]
    conv1, conv2 = events.Images("features/conv1")[0], events.Images("features/conv2")[0]
    # 4 images x 6 channels of 14x14 in rows of 6 (a 1-pixel border): 6 * 15 + 1 wide, 4 * 15 + 1 high
    assert (conv1.width, conv1.height) == (91, 61)
    assert (conv2.width, conv2.height) == (16 * 6 + 1, 4 * 6 + 1)  # 4 x 16 channels of 5x5
    for dtype in (torch.bfloat16, torch.float64):  # --precision bf16-true, 64-true: the weights in that dtype
        writer = SummaryWriter(tmp_path / str(dtype))
        log_images(writer, LeNet5(Config()).to(dtype), result, (x, y), step=1)
        writer.close()
        assert "features/conv1" in EventAccumulator(str(tmp_path / str(dtype))).Reload().Tags()["images"]


def test_epoch_order_matches_distributed_sampler():
    from torch.utils.data import DistributedSampler

    cfg = Config(seed=7)
    for n, world in ((100, 2), (101, 2), (513, 2), (10, 3), (2, 4), (1, 3)):  # uneven counts are padded alike
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
            sampler.set_epoch(3)
            assert list(sampler) == epoch_order(n, 3, cfg, rank, world).tolist()


@pytest.mark.slow
def test_two_processes_finish_when_the_samples_do_not_split_evenly(mnist_dir, tmp_path):
    """513 samples on 2 ranks of 256 a step: unpadded, rank 0 had a second step that rank 1 never joined (a hang)."""
    run_script("fabric_lenet.py", *QUICK, "--train-samples", "513", *FEW_TEST_IMAGES, "--batch-size", "512",
               "--epochs", "1", "--devices", "2", "--strategy", "ddp", "--data-dir", mnist_dir, "--out-dir", tmp_path,
               "--run-name", "uneven", timeout=180)
    summary = read_summary(tmp_path / "uneven")
    assert (summary["world_size"], summary["steps"], summary["epochs"]) == (2, 2, 1)
    assert summary["samples_per_s"] * summary["train_time_s"] == pytest.approx(514)  # one sample twice, as padded


def test_random_shift_is_a_crop_of_the_padded_image():
    x = torch.randn(64, 1, 28, 28)
    shifted = random_shift(x, torch.Generator().manual_seed(5), fill=float(x.min()))
    oy, ox = torch.randint(0, 5, (2, 64), generator=torch.Generator().manual_seed(5))  # the same draws
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), value=float(x.min()))
    for i in range(64):
        assert torch.equal(shifted[i], padded[i, :, oy[i]:oy[i] + 28, ox[i]:ox[i] + 28])


def test_windows_are_every_shift_and_both_data_paths_give_the_same_shifted_batches(mnist_dir):
    """datasets_local.windows against crops of the padded images (all 25 windows of each, a view of one padded copy);
    then fabric_lenet's two data paths from a step mid-epoch: the in-memory batches (one gather from the windows of
    the uint8 pixels, normalized as gathered) equal the DataLoader's (each batch shifted after it is loaded), the
    same images, labels and shifts, each step's drawn from its seed."""
    import datasets_local
    from lightning.fabric import Fabric

    x = torch.randn(3, 1, 28, 28)
    windows, padded = datasets_local.windows(x, fill=-1.0), torch.nn.functional.pad(x, (2, 2, 2, 2), value=-1.0)
    assert windows.shape == (3, 5, 5, 28, 28) and windows.untyped_storage().nbytes() == padded.numel() * 4
    for oy in range(5):
        for ox in range(5):
            assert torch.equal(windows[:, oy, ox], padded[:, 0, oy:oy + 28, ox:ox + 28])
    cfg = Config(accelerator="cpu", train_samples=1100, data_dir=str(mnist_dir))
    fabric = Fabric(accelerator="cpu", devices=1)
    train_set, _ = fabric_lenet.load_data(cfg)
    order = epoch_order(1100, 1, cfg, 0, 1)
    pixels, _ = in_memory = fabric_lenet.memory_windows(train_set, fabric.device)  # raw pixels, normalized per batch
    assert pixels.dtype == torch.uint8 and pixels.untyped_storage().nbytes() == 1100 * 32 * 32
    memory = fabric_lenet.train_batches(fabric, cfg, train_set, order, 1, 3, 512, in_memory)
    loader = fabric_lenet.train_batches(fabric, dataclasses.replace(cfg, data="loader"), train_set, order, 1, 3, 512,
                                        None)
    batches = list(zip(memory, loader, strict=True))
    assert [n for (n, _), _ in batches] == [512, 76]
    for (n, (xm, ym)), (k, (xl, yl)) in batches:
        assert n == k and torch.equal(xm, xl) and torch.equal(ym, yl)
    assert not torch.equal(batches[0][0][1][0], train_set.tensors()[0][order[512:1024]])  # shifted


def test_the_background_is_every_mnist_images_minimum(mnist_dir):
    import datasets_local

    images = datasets_local.normalize(datasets_local.MNIST(mnist_dir, train=False).images[:500])
    assert torch.equal(images.amin((1, 2, 3)), torch.full((500,), BACKGROUND))


def test_random_shift_moves_content():
    x = torch.zeros(4, 1, 28, 28)
    x[:, :, 10:18, 10:18] = 1
    shifted = random_shift(x, torch.Generator().manual_seed(0), fill=0.0)
    assert shifted.shape == x.shape and torch.equal(shifted.sum((1, 2, 3)), x.sum((1, 2, 3)))
    assert not torch.equal(shifted, x)


def test_one_epoch_on_real_mnist_reaches_97_percent(mnist_dir, tmp_path):
    run_in_process("fabric_lenet.py", "--epochs", "1", "--data-dir", mnist_dir, "--out-dir", tmp_path, "--run-name", "one")
    s = read_summary(tmp_path / "one")
    assert s["test_acc"] >= 0.97, s["test_acc"]
    assert len(s["per_class_acc"]) == 10 and min(s["per_class_acc"]) > 0.9
    for key in ("epochs", "train_time_s", "samples_per_s", "config", "env"):
        assert key in s
    # 118 steps of 512 but 60,000 samples: the short last batch is counted as what it is
    assert s["samples_per_s"] * s["train_time_s"] == pytest.approx(60_000)
    assert (tmp_path / "one" / "checkpoints").is_dir() and list((tmp_path / "one").glob("events.out.tfevents.*"))


def test_dataloader_path_trains_exactly_like_the_in_memory_path(mnist_dir, tmp_path):
    common = [*QUICK, "--epochs", "1", "--max-steps", "30", *FEW_TEST_IMAGES, "--data-dir", mnist_dir,
              "--out-dir", tmp_path]
    run_in_process("fabric_lenet.py", *common, "--data", "memory", "--run-name", "mem")
    run_in_process("fabric_lenet.py", *common, "--data", "loader", "--num-workers", "1", "--run-name", "loader")
    mem, loader = read_summary(tmp_path / "mem"), read_summary(tmp_path / "loader")
    assert mem["test_loss"] == loader["test_loss"] and mem["test_acc"] == loader["test_acc"]


@pytest.mark.slow
def test_two_process_ddp_matches_one_process(mnist_dir, tmp_path):
    common = [*QUICK, "--epochs", "1", "--max-steps", "40", "--batch-size", "64", "--data-dir", mnist_dir,
              "--out-dir", tmp_path]
    run_in_process("fabric_lenet.py", *common, "--run-name", "single")
    run_script("fabric_lenet.py", *common, "--devices", "2", "--strategy", "ddp", "--run-name", "ddp")
    single, ddp = read_summary(tmp_path / "single"), read_summary(tmp_path / "ddp")
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    # Same global batches, gradients averaged by gloo: equal up to float32 summation order.
    assert ddp["test_loss"] == pytest.approx(single["test_loss"], rel=1e-4)
    assert abs(ddp["test_acc"] - single["test_acc"]) <= 0.002
    # Lightning's own launcher: `fabric run` gives accelerator, devices and strategy; the same run (fabric run sets
    # OMP_NUM_THREADS to 1 per process, so float32 sums may differ in the last digits)
    fabric_run = Path(warm_python.REAL).with_name("fabric")
    proc = subprocess.run([warm_python.executable(), fabric_run, "run", "--accelerator", "cpu", "--devices", "2",
                           "--strategy", "ddp", "fabric_lenet.py", *map(str, common), "--run-name", "fabric-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    launched = read_summary(tmp_path / "fabric-run")
    assert launched["config"]["devices"] == 2 and launched["config"]["strategy"] == "ddp"
    assert launched["test_loss"] == pytest.approx(ddp["test_loss"], rel=1e-6) and launched["test_acc"] == ddp["test_acc"]


def test_gelu_cpp_activation_learns(mnist_dir, tmp_path):
    run_in_process("fabric_lenet.py", "--activation", "gelu_cpp", "--epochs", "1", "--train-samples", "12000", "--batch-size", "128",
               "--no-tb-images", "--data-dir", mnist_dir, "--out-dir", tmp_path, "--run-name", "gelu")
    s = read_summary(tmp_path / "gelu")
    last = s["history"][-1]
    assert s["test_acc"] > 0.9 and s["config"]["activation"] == "gelu_cpp"
    assert last["train_loss"] < 2.3  # below chance-level cross-entropy, ln(10)


@pytest.mark.parametrize("args,words", [
    (["--batch-size", "65", "--devices", "2", "--strategy", "ddp"], "divide evenly across 2"),
    (["--strategy", "dp"], "needs CUDA"),
    (["--precision", "16-mixed", "--accelerator", "cpu"], "needs a GPU"),
    (["--accelerator", "gpu"], "no CUDA GPU"),
    (["--num-workers", "2"], "--data loader only"),
    (["--gelu-approximate", "tanh"], "--activation relu computes no GELU"),
    (["--compile-mode", "reduce-overhead"], "add --compile"),
    (["--pad-channels", "8", "--no-channels-last"], "where it would pad nothing; drop one of them"),
    (["--sync-check", "--accelerator", "cpu"], "needs a GPU"),
    (["--cuda-graph", "--data", "loader"], "use --data memory"),
    (["--cuda-graph", "--optimizer", "sgd"], "use adamw"),
    (["--cuda-graph", "--compile"], "--compile-mode reduce-overhead"),
    (["--cuda-graph", "--devices", "2", "--strategy", "ddp"], "one device's step"),
])
def test_impossible_flags_are_refused_before_training(tmp_path, monkeypatch, args, words):
    monkeypatch.setattr(fabric_lenet, "find_run", lambda *a: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exit_:
        fabric_lenet.main([*args, "--out-dir", str(tmp_path)])
    message = str(exit_.value.code)
    assert message.startswith("error:") and words in message
    assert not list(tmp_path.iterdir())


def test_a_temporary_folder_too_long_for_a_loader_workers_socket_is_refused(tmp_path, monkeypatch):
    """A DataLoader worker binds a Unix socket at $TMPDIR/pymp-<8>/listener-<8> (107 bytes at most): with a longer
    folder its first batch never arrives: "worker exited unexpectedly", or, with one thread, the batch dropped and the
    run waiting forever (by hand: 76 bytes failed, 75 trained)."""
    class Started(Exception):
        pass

    monkeypatch.setattr(fabric_lenet, "find_run", lambda *a: (_ for _ in ()).throw(Started()))
    args = ["--data", "loader", "--num-workers", "1", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(tempfile, "tempdir", "/tmp/" + "x" * 71)  # 76 bytes
    with pytest.raises(SystemExit) as exit_:
        fabric_lenet.main(args)
    assert "is longer than the 75 bytes" in str(exit_.value.code) and "TMPDIR=/tmp" in str(exit_.value.code)
    monkeypatch.setattr(tempfile, "tempdir", "/tmp/" + "x" * 70)  # 75 bytes: trains
    with pytest.raises(Started):
        fabric_lenet.main(args)


def test_auto_precision_takes_the_faster_measured_step_and_caches_it(tmp_path):
    """--precision auto on a CPU: the faster of two timings (injected here; no timed assertion), measured once
    per key and then read from the cache; another key (a changed batch, CPU, torch, ...) measures again."""
    cache, calls = tmp_path / "probe.json", []

    def timings(fp32, bf16):
        return lambda: calls.append(1) or {"32-true": {"8": [fp32] * 8}, "bf16-mixed": {"8": [bf16] * 8}}

    key = cpu_speed.lenet_probe_key(Config())
    first = cpu_speed.choose_precision(key, cache, timings(100.0, 130.0))
    assert first["choice"] == "bf16-mixed" and not first["cached"] and len(calls) == 1
    again = cpu_speed.choose_precision(key, cache, timings(130.0, 100.0))  # not called: the cache answers
    assert again["choice"] == "bf16-mixed" and again["cached"] and len(calls) == 1
    other = {**key, "local_batch": key["local_batch"] // 2}
    assert cpu_speed.choose_precision(other, cache, timings(130.0, 100.0))["choice"] == "32-true"
    assert len(calls) == 2
    cache.write_text("{not json")  # a damaged cache is measured again, not an error
    assert cpu_speed.choose_precision(key, cache, timings(1.0, 2.0))["choice"] == "bf16-mixed" and len(calls) == 3


def test_auto_precision_takes_bf16_only_when_it_is_clearly_the_faster():
    """A lead within the windows' spread is the machine's moment, not the precision's: bf16 autocast is taken when its
    median is 5% ahead and it leads in 3 of 4 paired windows, else float32 (2026-11-28, a Xeon: the old probe chose
    bf16 at 7% ahead under another process's load, where quiet it runs 21% slower)."""
    fp32 = [100.0, 104, 98, 101, 99, 103, 100, 102]
    assert cpu_speed.faster_precision({"32-true": fp32, "bf16-mixed": [f * 1.3 for f in fp32]}) == "bf16-mixed"
    assert cpu_speed.faster_precision({"32-true": fp32, "bf16-mixed": [f * 1.03 for f in fp32]}) == "32-true"
    spiky = [f * (1.4 if i < 4 else 0.95) for i, f in enumerate(fp32)]  # ahead in half the windows only
    assert cpu_speed.faster_precision({"32-true": fp32, "bf16-mixed": spiky}) == "32-true"
    assert cpu_speed.faster_precision({"32-true": fp32, "bf16-mixed": [f * 0.8 for f in fp32]}) == "32-true"


def test_auto_padding_is_the_faster_for_each_precision_and_left_alone_where_nothing_is_timed():
    """--pad-channels auto: conv1 padded to 8 or not, whichever runs the precision's step faster (the padding changes
    no result, so it takes no margin); on a GPU 8 (tensor cores take whole multiples of 8), in NCHW nothing is padded,
    and a precision the probe does not time keeps 8."""
    cases = {"32-true": {"8": [100.0] * 8, "0": [150.0] * 8}, "bf16-mixed": {"8": [200.0] * 8, "0": [120.0] * 8}}
    chosen = cpu_speed.fastest(cases)
    assert (chosen["choice"], chosen["pad_channels"], chosen["windows"]["32-true"]) == ("bf16-mixed", 8, [150.0] * 8)
    assert cpu_speed.fastest({"32-true": cases["32-true"]})["pad_channels"] == 0
    never = lambda pad: pytest.fail("measured")  # noqa: E731
    assert cpu_speed.lenet_cpu_choice(Config(accelerator="gpu", precision="32-true"), never) == ("32-true", 8, None)
    assert cpu_speed.lenet_cpu_choice(Config(channels_last=False, precision="32-true"), never) == ("32-true", 0, None)
    assert cpu_speed.lenet_cpu_choice(Config(precision="64-true"), never) == ("64-true", 8, None)


def test_a_probe_taken_beside_other_processes_load_is_not_kept(tmp_path, monkeypatch):
    """--precision auto's probe on a CPU whose cores other processes fill (two spinning shells a core): the run takes
    its answer, its line says it was not kept, and the next run measures again rather than reading a busy moment's
    figures (measurements.quiet_enough)."""
    monkeypatch.delenv("FABRIC_LAB_KEEP_BUSY_MEASUREMENTS", raising=False)
    cfg = Config(batch_size=64, cache_dir=str(tmp_path), accelerator="cpu")
    make = lambda p: LeNet5(dataclasses.replace(cfg, pad_channels=p))  # noqa: E731
    spin = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(2 * os.cpu_count())]
    try:
        probe = cpu_speed.lenet_cpu_choice(cfg, make)[2]
        assert probe["cached"] is False and "not kept: the machine was busy" in cpu_speed.probe_line(probe)
        assert not (tmp_path / "precision-probe.json").exists()
    finally:
        for p in spin:
            p.kill()
            p.wait()


def test_auto_precision_without_bf16_instructions_times_float32_alone(tmp_path, monkeypatch):
    """Where the CPU has no bf16 instructions (torch emulates bf16: a tenth of float32's speed under the AVX2 caps),
    --precision auto is float32 without timing bf16, as GPT-2's: the probe times the padding alone, or nothing when
    --pad-channels is named, and the line says why. Without --cache-dir the answer is kept where FABRIC_LAB_CACHE
    says, as every other measurement (the suite's own folder: no user's figure decides a test)."""
    monkeypatch.setattr(cpu_speed, "native_bf16", lambda: False)
    monkeypatch.setenv("FABRIC_LAB_CACHE", str(tmp_path))
    cfg = Config(batch_size=64)
    precision, pad, probe = cpu_speed.lenet_cpu_choice(cfg, lambda p: LeNet5(dataclasses.replace(cfg, pad_channels=p)))
    assert precision == probe["choice"] == "32-true" and pad in (8, 0) and list(probe["cases"]) == ["32-true"]
    assert set(probe["cases"]["32-true"]) == {"8", "0"} and cpu_speed.NO_BF16 in cpu_speed.probe_line(probe)
    never = lambda pad: pytest.fail("measured")  # noqa: E731
    assert (tmp_path / "precision-probe.json").exists()
    assert cpu_speed.lenet_cpu_choice(Config(batch_size=64, cache_dir=str(tmp_path)), never)[:2] == (precision, pad)
    precision, pad, probe = cpu_speed.lenet_cpu_choice(Config(pad_channels=8, cache_dir=str(tmp_path)), never)
    assert (precision, pad) == ("32-true", 8)
    assert cpu_speed.probe_line(probe) == f"auto: --precision 32-true ({cpu_speed.NO_BF16}; --precision forces one)"
    # bf16 asked for without the instructions: emulated, its padding is not timed either (8, the layout's default)
    assert cpu_speed.lenet_cpu_choice(Config(precision="bf16-mixed", cache_dir=str(tmp_path)), never) == ("bf16-mixed", 8, None)
    monkeypatch.setattr(cpu_speed, "native_bf16", lambda: True)  # with them both are timed (the key says which)
    assert cpu_speed.lenet_probe_key(Config())["precisions"] == list(cpu_speed.MEASURED)


def test_auto_precision_key_follows_the_settings_that_change_the_step(monkeypatch):
    for cap in hardware.isa_caps():  # a suite run under caps (docs/tests.md)
        monkeypatch.delenv(cap)
    base = cpu_speed.lenet_probe_key(Config())
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_speed.lenet_probe_key(Config()) != base  # a cap picks other kernels: measured again
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert base["local_batch"] == 512 and base["cpu"] and base["torch"] == torch.__version__
    assert cpu_speed.lenet_probe_key(Config(devices=2))["local_batch"] == 256
    # a larger batch is timed at the probe's largest, whose samples cost as much: 60,000 took minutes before any line
    assert cpu_speed.lenet_probe_key(Config(batch_size=60000))["local_batch"] == cpu_speed.PROBE_BATCH == 1024
    assert cpu_speed.lenet_probe_key(Config(batch_size=60000)) == cpu_speed.lenet_probe_key(Config(batch_size=2048))
    assert cpu_speed.lenet_probe_key(Config(channels_last=False)) != base
    assert cpu_speed.lenet_probe_key(Config(activation="gelu_py")) != base


def test_auto_precision_is_measured_recorded_and_forced_flags_win(mnist_dir, tmp_path):
    common = ["--epochs", "1", "--max-steps", "2", "--no-tb-images", "--accelerator", "cpu", "--data-dir", mnist_dir,
              "--out-dir", tmp_path, "--cache-dir", tmp_path / "cache", *FEW_TEST_IMAGES]
    proc = run_in_process("fabric_lenet.py", *common, "--run-name", "auto")
    probe = read_summary(tmp_path / "auto")["precision_probe"]
    timed = {"32-true", "bf16-mixed"} if hardware.native_bf16() else {"32-true"}  # without bf16 instructions: float32
    assert set(probe["samples_per_s"]) == timed and not probe["cached"]
    assert probe["choice"] == (cpu_speed.faster_precision(probe["windows"]) if len(timed) > 1 else "32-true")
    assert len(probe["windows"]["32-true"]) == 8
    assert read_summary(tmp_path / "auto")["config"]["precision"] == probe["choice"]
    assert f"auto: --precision {probe['choice']} --pad-channels {probe['pad_channels']} (" in proc.stdout
    assert "measured now" in proc.stdout and set(probe["cases"]["32-true"]) == {"8", "0"}
    assert read_summary(tmp_path / "auto")["config"]["pad_channels"] == probe["pad_channels"]
    proc = run_in_process("fabric_lenet.py", *common, "--run-name", "again")
    assert read_summary(tmp_path / "again")["precision_probe"]["cached"] and "cached" in proc.stdout
    cache = tmp_path / "cache" / "precision-probe.json"  # now saying the others: a resume keeps the run's own, the
    other = {"32-true": "bf16-mixed", "bf16-mixed": "32-true"}[probe["choice"]]  # padding too (its rounding)
    measured = cache.read_text()
    cache.write_text(json.dumps({k: {**v, "choice": other, "pad_channels": 8 - v["pad_channels"]}
                                 for k, v in json.loads(measured).items()}))
    proc = run_in_process("fabric_lenet.py", *common, "--run-name", "again", "--resume", "auto", "--max-steps", "3")
    resumed = read_summary(tmp_path / "again")
    kept = resumed["config"]["precision"], resumed["config"]["pad_channels"]
    assert kept == (probe["choice"], probe["pad_channels"])
    assert (f"--precision auto: {probe['choice']}, --pad-channels auto: {probe['pad_channels']} (the resumed run's own"
            in proc.stdout), proc.stdout[-2000:]
    cache.write_text(measured)  # without bf16 instructions auto's key is --precision 32-true's too
    run_in_process("fabric_lenet.py", *common, "--run-name", "forced", "--precision", "32-true", "--pad-channels", "8")
    forced = read_summary(tmp_path / "forced")
    assert forced["config"]["precision"] == "32-true" and forced["precision_probe"] is None
    run_in_process("fabric_lenet.py", *common, "--run-name", "padded", "--precision", "32-true")  # the padding alone
    padded = read_summary(tmp_path / "padded")
    assert list(padded["precision_probe"]["cases"]) == ["32-true"] and padded["config"]["precision"] == "32-true"
    assert padded["config"]["pad_channels"] == padded["precision_probe"]["pad_channels"] in (8, 0)


def test_a_run_name_that_exists_is_refused_before_any_work(mnist_dir, tmp_path):
    common = [*QUICK, "--epochs", "1", "--max-steps", "2", *FEW_TEST_IMAGES, "--data-dir", mnist_dir,
              "--out-dir", tmp_path]
    run_in_process("fabric_lenet.py", *common, "--run-name", "taken")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "taken").rglob("*")}
    proc = run_in_process("fabric_lenet.py", *common, "--run-name", "taken", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "exists" in last and "--resume auto --run-name taken" in last
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "taken").rglob("*")} == before  # nothing touched
    run_in_process("fabric_lenet.py", *common, "--run-name", "taken", "--resume", "auto", "--max-steps", "3")
    assert read_summary(tmp_path / "taken")["steps"] == 3


def test_more_training_samples_than_mnist_has_are_refused(mnist_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        fabric_lenet.main(["--train-samples", "70000", "--data-dir", str(mnist_dir), "--out-dir", str(tmp_path)])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith(
        "error: --train-samples must be an integer >= 1 and <= 60000, or 0, got 70000")
    assert not list(tmp_path.iterdir())  # refused before a run folder was made


@pytest.mark.parametrize("args,words", [
    (["--activation", "swish"], "--activation must be one of relu, gelu_torch, gelu_py, gelu_cpp, got swish"),
    (["--epochs", "0"], "--epochs must be an integer >= 1"),
    (["--pad-channels", "4"], "--pad-channels must be an integer >= 6 and <= 64, or 0, or auto, got 4"),
    (["--label-smoothing", "1"], "--label-smoothing must be a finite number >= 0 and < 1, got 1"),
    (["--run-name", "/tmp/elsewhere"], "--run-name must be a plain folder name"),
    (["--run-name", ".."], "--run-name must be a plain folder name"),
])
def test_a_value_out_of_its_range_is_one_argparse_line(capsys, tmp_path, args, words):
    with pytest.raises(SystemExit) as exit_:
        fabric_lenet.main([*args, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"error: {words}") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


def test_bad_flag_from_the_command_line_is_one_line(tmp_path):
    proc = run_script("fabric_lenet.py", "--strategy", "dp", "--out-dir", tmp_path, check=False, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: --strategy dp")


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        fabric_lenet.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(Config):
        name = field.name.replace("_", "-")
        assert (f"--[no-]{name}" if field.type is bool or field.default is None else f"--{name}") in text
    assert "global batch: split evenly across all processes (default: 512)" in text
    assert "relu, gelu_torch (F.gelu), gelu_py, gelu_cpp (gelu_ext/) (default: relu)" in text


def test_a_lenet_step_reads_no_device_value_between_check_points(mnist_dir, tmp_path, monkeypatch):
    """The loss stays on the device until a log point, evaluation or checkpoint (one transfer for all the steps
    since the last), and the shifts fill with a constant background: a run of 30 more steps reads nothing more
    (the evaluation reads its figures once, whatever the number of test batches: two numbers and three lists)."""
    from conftest import host_reads

    common = ["--epochs", "1", "--no-tb-images", "--data-dir", mnist_dir, "--out-dir", tmp_path, "--log-every", "1000",
              "--accelerator", "cpu"]
    short = host_reads(monkeypatch, fabric_lenet, *common, "--max-steps", "10", "--run-name", "short")
    long = host_reads(monkeypatch, fabric_lenet, *common, "--max-steps", "40", "--run-name", "long")
    training = lambda reads: {k: v for k, v in reads.items() if k[1] != "evaluate"}  # noqa: E731
    assert training(long) == training(short) == {("tolist", "read"): 1}, (short, long)
    evaluation = {k: v for k, v in long.items() if k[1] == "evaluate"}  # 10 test batches, errors in each
    assert evaluation == {("__float__", "evaluate"): 2, ("tolist", "evaluate"): 3}, evaluation


def test_a_nan_in_lenet_is_named_by_its_step_at_the_next_check_point(mnist_dir, tmp_path):
    proc = run_in_process("fabric_lenet.py", "--epochs", "1", "--max-steps", "12", "--lr", "1e12", "--optimizer", "sgd",
                          "--no-tb-images", "--data-dir", mnist_dir, "--out-dir", tmp_path, "--run-name", "nan",
                          "--log-every", "10", "--checkpoint-every", "10", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    step = int(re.search(r"at step (\d+)", last).group(1))
    assert proc.returncode == 1 and "loss became" in last and step < 10 and "no checkpoint was saved" in last, last


COMPILED_SOFTMAX = """
import torch
from core.run import hardware

hardware.compile_cache_per_caps()
x = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
f = lambda t: (t.softmax(-1) * 3 + t.relu()).sum(-1)
print((torch.compile(f, dynamic=False)(x) - f(x)).abs().max().item())
"""


@pytest.mark.slow
def test_a_graph_compiled_without_caps_is_not_served_under_them():
    """Inductor writes a CPU kernel for the vector width ATEN_CPU_CAPABILITY allows but does not key its cache of
    compiled graphs by it: without hardware.compile_cache_per_caps, this function compiled once without the cap and
    then served under ATEN_CPU_CAPABILITY=avx2 was 27 off (an AVX-512 EPYC), and served under `default` (no vector
    code) failed to compile. The cap is the one below what this machine (or the suite's own cap) runs, so that the
    two runs differ on a CPU without AVX-512 too. In inductor's own cache folder, as a user's runs: 10 s once warm,
    30 s on an empty cache (this EPYC)."""
    capability = torch.backends.cpu.get_cpu_capability()
    below = {"AVX512": "avx2", "AVX2": "default"}.get(capability)
    if below is None:
        pytest.skip(f"ATen runs {capability} here: no narrower cap to compile under")
    for caps in ({}, {"ATEN_CPU_CAPABILITY": below}):
        error = float(run_script("-c", COMPILED_SOFTMAX, env=caps).stdout.split()[-1])
        assert error < 1e-4, (caps, error)


def test_every_schedule_steps_through_runs_of_any_length():
    """OneCycleLR divides by zero when its warm-up is exactly one step (pct_start 0.2 of 5 steps): a run of 2,560
    training images in one epoch, or 512 in five, ended in a traceback before its first step."""
    model = torch.nn.Linear(4, 2)
    for schedule in ("onecycle", "cosine", "constant"):
        for total in range(1, 41):
            optimizer, scheduler = fabric_lenet.make_optimizer(Config(schedule=schedule), model, total)
            for _ in range(total):
                optimizer.step()
                scheduler.step()
            assert max(scheduler.get_last_lr()) <= Config().lr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_steps_give_the_eager_losses(mnist_dir, tmp_path, tmp_path_factory, mode):
    """torch.compile'd LeNet-5 (the GPU recipe's path; reduce-overhead is CUDA graphs on a GPU) trains as the eager
    model does: the same test loss after two epochs of 2,200 images (4 x 512 + 152) with augmentation, to float32
    reordering, compiled once per shape: the full batch, the short last one, evaluation's (a recompile per epoch, or
    conv1's dtype note failing a guard, adds one). On a CPU the run says that no graphs were captured, and why. The
    eager run is made once for both modes. conv1's padding is named: auto times it anew in each session of the suite
    (its cache is the session's), under the load of the other workers, and an answer that changes changes the graph,
    which inductor's cache of compiled graphs then misses (a warm run: 33 s, against 6 s where it hit)."""
    common = ["--epochs", "2", "--train-samples", "2200", "--precision", "32-true", "--pad-channels", "8",
              "--no-tb-images", "--accelerator", "cpu", "--data-dir", mnist_dir, "--log-every", "5", *FEW_TEST_IMAGES]
    eager_runs = shared_dir(tmp_path_factory, "lenet-eager-2200", lambda out: run_in_process(
        "fabric_lenet.py", *common, "--out-dir", out, "--run-name", "eager"))
    proc = run_in_process("fabric_lenet.py", *common, "--out-dir", tmp_path, "--compile", "--compile-mode", mode,
                          "--run-name", "compiled")
    eager, compiled = read_summary(eager_runs / "eager"), read_summary(tmp_path / "compiled")
    assert compiled["test_loss"] == pytest.approx(eager["test_loss"], rel=1e-4)
    assert compiled["history"][-1]["train_loss"] == pytest.approx(eager["history"][-1]["train_loss"], rel=1e-4)
    assert (compiled["compiled_graphs"], compiled["compute_dtype"], eager["compiled_graphs"]) == (3, "torch.float32", None)
    if mode == "reduce-overhead":
        assert compiled["cuda_graphs"].startswith("not captured: CUDA graphs record CUDA kernels and this run is on cpu")
        assert "CUDA graphs not captured" in proc.stdout
    else:
        assert compiled["cuda_graphs"] is None


def test_time_to_accuracy_is_the_first_evaluation_at_the_target():
    history = [{"step": 10, "train_time_s": 1.0, "test_acc": 0.985}, {"step": 20, "train_time_s": 2.0, "test_acc": 0.9905},
               {"step": 30, "train_time_s": 3.0, "test_acc": 0.9899}, {"step": 40, "train_time_s": 4.0, "test_acc": 0.992}]
    assert lenet_figures.time_to_accuracy(history) == {"99.0%": {"train_time_s": 2.0, "step": 20, "wall_s": None},
                                                       "99.2%": {"train_time_s": 4.0, "step": 40, "wall_s": None}}
    assert lenet_figures.time_to_accuracy(history[:3])["99.2%"] is None


def test_steady_speed_leaves_out_each_start_s_first_epoch():
    history = [{"epoch": 1, "samples_per_s": 10.0}, {"epoch": 1, "partial": True, "samples_per_s": 0.0},
               {"epoch": 2, "samples_per_s": 30.0}, {"epoch": 3, "samples_per_s": 40.0}, {"epoch": 4, "samples_per_s": 20.0}]
    assert lenet_figures.steady_speed(history, first_epoch_here=0) == 30.0  # median of epochs 2-4
    assert lenet_figures.steady_speed(history, first_epoch_here=2) == 20.0  # resumed after epoch 2: epoch 3 starts up
    assert lenet_figures.steady_speed(history[:2], first_epoch_here=0) is None


# ----------------------------------------------------------------------------- the whole step (--cuda-graph)
def lenet_steps(mnist_dir, whole: bool, n: int = 1100, epochs: int = 2) -> tuple[list, list]:
    """Two epochs of the first n real training images at batch 512 (two full batches and a short one of 76 each
    epoch), augmented, through the eager step or the whole step: each step's loss and the weights after."""
    from lightning.fabric import Fabric

    import datasets_local
    from core.lenet import whole_step

    cfg = Config(accelerator="cpu", precision="32-true", train_samples=n, epochs=epochs, data_dir=str(mnist_dir))
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    fabric.seed_everything(0)
    train_set, _ = fabric_lenet.load_data(cfg)
    model, _ = fabric_lenet.make_model(cfg)
    epoch_steps = fabric_lenet.steps_per_epoch(n, cfg, 1)
    optimizer, scheduler = fabric_lenet.make_optimizer(cfg, model, epochs * epoch_steps)
    model, optimizer = fabric.setup(model, optimizer)
    windows = fabric_lenet.memory_windows(train_set, fabric.device)
    draw = lambda step, n: fabric_lenet.step_shifts(fabric, cfg, step, n, fabric.device)  # noqa: E731
    step = whole_step.WholeStep(fabric, cfg, model, optimizer, scheduler, windows, 512, epoch_steps, draw,
                                datasets_local.normalize) if whole else None
    losses, global_step = [], 0
    for epoch in range(epochs):
        order = epoch_order(n, epoch, cfg, 0, 1)
        if whole:
            for _ in step.epoch(order, 0, global_step):
                losses.append(float(step()))
                global_step += 1
            continue
        for _, (xb, yb) in fabric_lenet.train_batches(fabric, cfg, train_set, order, 0, global_step, 512, windows):
            losses.append(float(fabric_lenet.train_step(fabric, model, optimizer, scheduler, xb, yb, cfg)))
            global_step += 1
    return losses, [p.detach().clone() for p in model.parameters()]


def test_the_whole_step_gives_the_eager_steps_losses_across_short_batches(mnist_dir):
    """--cuda-graph's static program (on a GPU captured as one CUDA graph; here uncaptured) against the eager step,
    per step: the same samples (the short last batch padded with samples of weight zero), the same shifts, the same
    OneCycleLR learning rate and cycled beta1 (read by AdamW from device scalars), to float32 reordering."""
    eager, eager_weights = lenet_steps(mnist_dir, whole=False)
    whole, whole_weights = lenet_steps(mnist_dir, whole=True)
    assert len(whole) == len(eager) == 6
    assert whole == pytest.approx(eager, rel=2e-5), (whole, eager)
    assert eager[-1] < eager[0]  # it learns: the comparison is not between two runs that do nothing
    for got, want in zip(whole_weights, eager_weights):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_whole_step_run_stopped_mid_epoch_resumes_to_the_uninterrupted_loss(mnist_dir, tmp_path):
    """The epoch's tables are loaded from the step a resumed run starts at (its shifts from that step's seeds, its
    position on the device): stopped after 4 steps, in its second epoch, and resumed, it ends at the uninterrupted
    run's test loss; the record says the step was not captured, and why."""
    common = ["--cuda-graph", "--epochs", "2", "--train-samples", "1100", *FEW_TEST_IMAGES, "--precision", "32-true",
              "--no-tb-images", "--accelerator", "cpu", "--data-dir", mnist_dir, "--out-dir", tmp_path]
    run_in_process("fabric_lenet.py", *common, "--run-name", "whole")
    run_in_process("fabric_lenet.py", *common, "--run-name", "cut", "--max-steps", "4")
    run_in_process("fabric_lenet.py", *common, "--run-name", "cut", "--resume", "auto")
    whole, cut = read_summary(tmp_path / "whole"), read_summary(tmp_path / "cut")
    assert cut["steps"] == whole["steps"] == 6 and cut["test_loss"] == whole["test_loss"], (cut, whole)
    assert whole["cuda_graphs"].startswith("not captured: CUDA graphs record CUDA kernels and this run is on cpu")
