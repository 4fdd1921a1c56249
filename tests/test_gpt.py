"""fabric_gpt.py on CPU with real components: DDP with gloo, DeepSpeed ZeRO-2/3 and offload through
Fabric (tests/deepspeed_cpu lifts Lightning's CUDA-only guard), the meta-device parameter count, the
memory plan against DeepSpeed's estimators, checkpoint resume, and the bad inputs."""

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_script
import fabric_gpt as gpt

DEEPSPEED_ON_CPU = {"PYTHONPATH": f"{REPO / 'tests' / 'deepspeed_cpu'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
# A learnable sequence (each token is the previous + 1), so a wrong update would show in the losses.
SMALL = ["--model", "tiny", "--dataset", "ramp", "--lr", "1e-2", "--num-samples", "48", "--accelerator", "cpu",
         "--warmup-steps", "1"]


def losses(out: Path, name: str) -> list[float]:
    return [loss for _, loss in json.loads((out / name / "record.json").read_text())["losses"]]


def run_gpt(out: Path, name: str, *args, env=DEEPSPEED_ON_CPU):
    run_script("fabric_gpt.py", *SMALL, "--out-dir", out, "--run-name", name, *args, env=env)
    return losses(out, name)


def test_1_6b_preset_parameter_count():
    cfg = gpt.resolve(gpt.Config(model="1.6b"))
    h, L, V, S = 1600, 48, 50257, 1024
    expected = V * h + S * h + L * (12 * h * h + 13 * h) + 2 * h  # embeddings, blocks, final LayerNorm (lm_head tied)
    assert gpt.count_parameters(cfg) == expected == 1_557_611_200
    assert (cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.seq_len, cfg.lr) == (1600, 32, 48, 1024, 5e-4)


def test_tiny_model_learns(tmp_path):
    got = run_gpt(tmp_path, "learn", "--num-samples", "160", "--micro-batch-size", "8")
    assert len(got) == 20 and got[-1] < 0.5 * got[0], got


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return run_gpt(out, "single", "--micro-batch-size", "4")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Losses of 6-step runs on 2 processes, by strategy, made once and shared by the parity and resume tests."""
    out, cache = tmp_path_factory.mktemp("two"), {}

    def losses_of(strategy):
        if strategy not in cache:
            cache[strategy] = run_gpt(out, strategy, "--strategy", strategy, "--devices", "2", "--micro-batch-size", "2")
        return cache[strategy]
    return losses_of


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_2_offload",
                                      "deepspeed_stage_3_offload"])
def test_strategies_match_single_process(single, two_process_runs, strategy):
    """Same seed, same data, same global batch: the first loss equal, the following ones within float
    tolerance (they depend on each strategy's optimizer and gradient reduction being right)."""
    got = two_process_runs(strategy)
    assert got[0] == pytest.approx(single[0], abs=1e-5)
    assert got == pytest.approx(single, rel=2e-3), (got, single)
    assert got[-1] < got[0] - 0.5  # it learned


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_gradient_accumulation_equals_larger_batch(tmp_path, strategy):
    one = run_gpt(tmp_path, "one", "--strategy", strategy, "--devices", "2", "--micro-batch-size", "4")
    accumulated = run_gpt(tmp_path, "accum", "--strategy", strategy, "--devices", "2", "--micro-batch-size", "2",
                          "--grad-accum", "2")
    assert len(one) == len(accumulated) == 6
    assert accumulated == pytest.approx(one, rel=2e-3), (accumulated, one)


def test_gradient_checkpointing_leaves_loss_and_gradients_unchanged():
    cfg = gpt.resolve(gpt.Config(model="tiny"))
    tokens = gpt.make_dataset(cfg).tensors[0][:4]
    results = []
    for ckpt in (False, True):
        model = gpt.build_model(gpt.dataclasses.replace(cfg, grad_checkpointing=ckpt)).train()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_checkpoint_saves_and_resumes(tmp_path, two_process_runs, strategy):
    args = ["--strategy", strategy, "--devices", "2", "--micro-batch-size", "2"]
    whole = two_process_runs(strategy)  # the same flags, never interrupted
    run_gpt(tmp_path, "cut", *args, "--steps", "3")  # ends early; the schedule still spans all 6 steps
    ckpt = tmp_path / "cut" / "checkpoints" / "step-00000003"
    assert (ckpt / "config.json").exists() and (ckpt / "state").exists()
    proc = run_script("fabric_gpt.py", *SMALL, *args, "--out-dir", tmp_path, "--run-name", "cut", "--resume", "auto",
                      env=DEEPSPEED_ON_CPU)
    assert "resumed from" in proc.stdout
    assert losses(tmp_path, "cut") == pytest.approx(whole, rel=1e-5)


def test_zero_checkpoint_on_other_world_size_is_refused(tmp_path):
    args = ["--strategy", "deepspeed_stage_2", "--micro-batch-size", "2"]
    run_gpt(tmp_path, "z", *args, "--devices", "2", "--steps", "2")
    proc = run_script("fabric_gpt.py", *SMALL, *args, "--devices", "1", "--num-samples", "48", "--out-dir", tmp_path,
                      "--run-name", "z", "--resume", "auto", env=DEEPSPEED_ON_CPU, check=False)
    assert proc.returncode == 1 and "sharded over 2 processes" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
                                      "deepspeed_stage_3_offload"])
@pytest.mark.parametrize("devices", [1, 8])
def test_plan_model_states_agree_with_deepspeed_estimator(strategy, devices):
    cfg = gpt.resolve(gpt.Config(model="1.6b", strategy=strategy, devices=devices, precision="bf16-mixed"))
    n = gpt.count_parameters(cfg)
    plan = gpt.memory_plan(cfg, n, gpt.largest_layer_params(cfg))
    ours = plan["params"] + plan["grads"] + plan["optimizer"] + plan["gathered_layer"]
    assert plan["deepspeed_estimate"] is not None
    assert ours == pytest.approx(plan["deepspeed_estimate"], rel=1e-6)


def test_plan_answers_which_strategy_fits(tmp_path):
    def plan(*args):
        proc = run_script("fabric_gpt.py", "--model", "1.6b", "--plan", "--device-memory-gb", "24",
                          "--precision", "bf16-mixed", "--micro-batch-size", "1", *args)
        return proc.stdout

    assert "does NOT fit" in plan("--strategy", "ddp", "--devices", "2")
    fits = plan("--strategy", "deepspeed_stage_3", "--devices", "8", "--grad-checkpointing")
    assert "fits in 24 GiB" in fits and "DeepSpeed's estimator" in fits and "1,557.6M parameters" in fits


@pytest.mark.parametrize("args,words", [
    (["--strategy", "ddp", "--nvme-path", "/tmp/nvme"], "--nvme-path offloads through DeepSpeed ZeRO-3"),
    (["--devices", "512", "--accelerator", "cpu"], "CPU cores"),
    (["--strategy", "deepspeed_stage_2", "--accelerator", "cpu"], "needs CUDA GPUs"),
    (["--num-samples", "10", "--micro-batch-size", "4"], "not a multiple of the 4 samples per optimizer step"),
    (["--n-embd", "30", "--n-head", "4"], "divisible"),
    (["--precision", "16-mixed", "--accelerator", "cpu"], "needs a GPU"),
])
def test_bad_inputs_fail_before_any_model_is_built(tmp_path, monkeypatch, args, words):
    built = []
    monkeypatch.setattr(gpt, "build_model", lambda cfg: built.append(cfg))  # would record any model built
    with pytest.raises(SystemExit) as exit_:
        gpt.main([*args, "--out-dir", str(tmp_path)])
    message = str(exit_.value.code)
    assert message.startswith("error:") and words in message and "\n" not in message
    assert not built and not list(tmp_path.iterdir())


@pytest.mark.parametrize("args", [["--model", "gpt5"], ["--strategy", "zero4"], ["--precision", "fp8"]])
def test_unknown_preset_strategy_precision_are_argparse_errors(capsys, args):
    with pytest.raises(SystemExit) as exit_:
        gpt.parse_args(args)
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_zero3_checkpoint_converts_to_one_ordinary_state_dict(tmp_path):
    """The README's recipe: DeepSpeed's zero_to_fp32 gathers the shards into a plain GPT-2 state dict."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run_gpt(tmp_path, "z3", "--strategy", "deepspeed_stage_3", "--devices", "2", "--micro-batch-size", "2", "--steps", "2")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "z3" / "checkpoints" / "step-00000002" / "state"))
    cfg = gpt.resolve(gpt.Config(model="tiny"))
    model = gpt.build_model(cfg)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the token embedding
    assert all(torch.isfinite(t).all() for t in state_dict.values())
    assert not torch.equal(model.transformer.h[0].attn.c_attn.weight, gpt.build_model(cfg).transformer.h[0].attn.c_attn.weight)
