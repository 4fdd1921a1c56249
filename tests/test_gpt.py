"""fabric_gpt.py on CPU with real components: every strategy (DDP, ZeRO-1/2/3 and offload through the CPU
DeepSpeed strategy, FSDP2, tensor parallel, 2-D, pipeline parallel) on 2 real processes against one
process, accumulation, resume, export to one state dict, the memory plan, and the bad inputs."""

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import fabric_gpt as gpt
from conftest import (EXACT, REPO, SMALL, TWO_PROCESS, free_port, host_reads, losses, record, run_gpt, run_in_process,
                      run_nodes, run_script, shared_dir, sized_disk)
from core.gpt import gpt_model, strategies
from core.plan import accounting, comm_counter, gpt_figures, perf_model
from core.host import warm_python
from core.run import hardware, layout, measurements


# A learnable sequence (each token is the previous + 1), so a wrong update would show in the losses.
def exported(run_dir: Path) -> dict:
    """The weights of a run's Hugging Face folder (--export), every shard."""
    from safetensors.torch import load_file

    return {k: v for f in sorted((run_dir / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}


def test_1_6b_preset_parameter_count():
    cfg = gpt.resolve(gpt.Config(model="1.6b"))
    h, L, V, S = 1600, 48, 50257, 1024
    expected = V * h + S * h + L * (12 * h * h + 13 * h) + 2 * h  # embeddings, blocks, final LayerNorm (lm_head tied)
    assert gpt.count_parameters(cfg)[0] == expected == 1_557_611_200
    assert (cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.seq_len, cfg.lr) == (1600, 32, 48, 1024, 5e-4)


def test_the_built_model_is_initial_weights_by_name_with_its_head_tied():
    """build_model skips transformers' own initialisation: every weight is still `initial_weights` of its name, and
    lm_head is the token embedding itself (untied, it would be a second matrix of its own, drawn and trained apart)."""
    cfg = gpt.resolve(gpt.Config(model="tiny"))
    model = gpt.build_model(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight and not list(model.buffers())
    for name, p in model.named_parameters():
        assert torch.equal(p, gpt_model.initial_weights(name, p.shape, cfg)), name


@pytest.fixture(scope="module")
def single_adamw(tmp_path_factory):
    """One process with AdamW and clipping, the reference of the offload runs (DeepSpeed's CPU Adam)."""
    make = lambda out: run_gpt(out, "one", "--micro-batch-size", "4", "--lr", "3e-3")  # as OFFLOAD
    return shared_dir(tmp_path_factory, "gpt-single-adamw", make), "one"


def test_single_process_learns(single):
    got = losses(*single)
    assert len(got) == 12 and got[-1] < got[0] - 0.3, got


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO_PROCESS))
def test_strategy_equals_one_process(single, two_process, name):
    """Same seed, samples and global batch: every step's loss and gradient norm, and the final weights
    gathered from the shards into one GPT-2 state dict, equal the single process's (float tolerance)."""
    out, run = two_process(name)
    ref, got = record(*single), record(out, run)
    assert got["world_size"] == 2
    # ZeRO-3 built the model partitioned (no rank held it whole), and still equals the whole build below
    assert got["model_build"].startswith("partitioned") == (name == "deepspeed_stage_3")
    assert got["losses"][0][1] == pytest.approx(ref["losses"][0][1], abs=1e-5)
    assert [l for _, l in got["losses"]] == pytest.approx([l for _, l in ref["losses"]], rel=1e-4)
    assert [n for _, n in got["grad_norms"]] == pytest.approx([n for _, n in ref["grad_norms"]], rel=1e-4)
    w_ref = exported(single[0] / "single")
    w_got = exported(out / run)
    assert set(w_got) == set(w_ref)
    for key in w_ref:
        torch.testing.assert_close(w_got[key], w_ref[key], rtol=1e-4, atol=1e-5, msg=key)
    changed = w_ref["transformer.h.0.attn.c_attn.weight"] - gpt.build_model(gpt.resolve(gpt.Config())).transformer.h[0].attn.c_attn.weight
    assert changed.abs().max() > 1e-3  # the comparison is about trained weights
    # what the user reads: no library warnings (DeepSpeed's deprecated collectives, transformers' unnamed loss, on a
    # CPU DeepSpeed's and torch's that they found no GPU), and each rank's line whole
    log = (out / f"{name}.log").read_text()
    assert "Warning:" not in log and "loss_type" not in log, log[:3000]
    assert "unable to detect it" not in log and "No CUDA runtime is found" not in log, log[:3000]
    assert "built successfully" not in log, log[:3000]  # DeepSpeed's per-rank line for an op it only loaded
    assert len(re.findall(r"^rank [01]/2: .*\)$", log, re.M)) == 2, log[:3000]


OFFLOAD = ["--devices", "2", "--micro-batch-size", "2", "--lr", "3e-3"]


def comm_rows(table: list) -> list:
    """Transfers of groups of 2 or more (a group of one moves nothing), as comparable tuples."""
    return sorted((r["kind"], r["group_size"], r["bytes"], r["count"]) for r in table if r["group_size"] > 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*TWO_PROCESS, "deepspeed_stage_2_offload", "deepspeed_stage_3_offload"])
def test_counted_traffic_equals_the_plan(two_process, offload_run, name):
    """What each rank issued in one optimizer step after warm-up (DDP's reducer, FSDP2, DTensor, DeepSpeed and the
    pipeline schedules, as the dispatcher saw them) equals perf_model's table call for call: every kind, group,
    size and count, with accumulation 2 (data parallel, pipelines) and 1 (tp, offload)."""
    out, run = offload_run(name) if name.endswith("_offload") else two_process(name)
    rec = record(out, run)
    assert rec["comm_counted_step"] == 3  # after the 2 warm-up steps (DDP rebuilds its buckets in step 2)
    planned = comm_rows(rec["comm_planned"])
    assert planned and comm_rows(rec["comm_counted"]) == planned
    for table in rec["comm_counted_by_rank"]:  # 2 ranks (2 stages under pp) hand over the same bytes per kind
        assert comm_counter.bytes_by_kind(table) == comm_counter.bytes_by_kind(rec["comm_planned"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy,args", [
    ("ddp", ["--timing-warmup", "1", "--optimizer", "sgd"]),  # step 2 rebuilds DDP's buckets: not the one counted
    ("deepspeed_stage_2", ["--timing-warmup", "2", "--optimizer", "sgd", "--grad-clip", "1", "--grad-accum", "2"]),
])
def test_a_steady_step_is_counted_whatever_the_warm_up(tmp_path, strategy, args):
    """The counted step is one whose traffic repeats (no set-up broadcast), and SGD with clipping under ZeRO-2
    all-reduces its one parameter group's norm once, as planned."""
    run_gpt(tmp_path, "c", "--model", "tiny", "--n-embd", "96", "--n-head", "4", "--n-layer", "3", "--seq-len", "48",
            "--vocab-size", "384", "--devices", "2", "--steps", "4", "--strategy", strategy, "--micro-batch-size", "2",
            "--num-samples", "96", "--count-comms", *args)
    rec = record(tmp_path, "c")
    assert rec["comm_counted_step"] == 3 and "the first after warm-up" in rec["comm_counted_why"]
    assert "broadcast" not in {r["kind"] for r in rec["comm_counted"]}
    assert comm_rows(rec["comm_counted"]) == comm_rows(rec["comm_planned"])


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory):
    """Uninterrupted 2-process ZeRO-Offload runs, each made once: compared with one process, and the ZeRO-3 one
    also with a stopped and resumed run."""
    def get(strategy: str):
        def make(out):
            run_gpt(out, strategy, "--strategy", strategy, *OFFLOAD, "--count-comms", "--checkpoint-every", "2",
                    "--keep-last", "6")  # its mid-run checkpoint is resumed
        return shared_dir(tmp_path_factory, f"gpt-{strategy}", make), strategy
    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["deepspeed_stage_2_offload", "deepspeed_stage_3_offload"])
def test_offload_equals_one_process(single_adamw, offload_run, strategy):
    """ZeRO-Offload steps with DeepSpeed's CPU Adam (it refuses SGD): compared with AdamW on one process."""
    one, off = losses(*single_adamw), losses(*offload_run(strategy))
    assert off[0] == pytest.approx(one[0], abs=1e-5)
    assert off == pytest.approx(one, rel=2e-3) and off[-1] < off[0] - 0.5


# DeepSpeed swaps only tensors of at least 1 MiB (MIN_AIO_BYTES): 0.83M parameters give each of 2 ranks 1.6 MiB
# lr 3e-3: at 1e-2 this model's first 12 steps go up and down (the AdamW of one process too), and CPU Adam's
# rounding, which differs from torch's, grows along such a path
SWAPPED = ["--n-embd", "128", "--n-layer", "4", "--lr", "3e-3"]


@pytest.mark.slow
@pytest.mark.builds  # DeepSpeed's async I/O and pinned-memory ops
def test_nvme_offload_equals_one_process(tmp_path):
    """ZeRO-Infinity: each rank's float32 partition and AdamW's two moments live in files under --nvme-path
    (here on the test's disk), swapped in and out every step through DeepSpeed's libaio op."""
    nvme = tmp_path / "nvme"
    run_gpt(tmp_path, "one", *SWAPPED, "--micro-batch-size", "4")
    # in a fresh checkout this run first builds DeepSpeed's async I/O and pinned-memory ops (356 s with a 1-process
    # run on the AVX2 EPYC): make setup leaves them to the first --nvme-path run
    run_gpt(tmp_path, "nvme", *SWAPPED, "--strategy", "deepspeed_stage_3_offload", *OFFLOAD, "--nvme-path", nvme,
            timeout=1500)
    one, off = losses(tmp_path, "one"), losses(tmp_path, "nvme")
    assert off[0] == pytest.approx(one[0], abs=1e-5)
    assert off == pytest.approx(one, rel=2e-3) and off[-1] < off[0] - 0.3
    for rank in (0, 1):
        files = sorted((nvme / "zero_stage_3" / "optimizer" / f"rank{rank}").glob("*.tensor.swp"))
        assert len(files) == 3 and all(f.stat().st_size >= 2**20 for f in files), files
        assert [f.name.split("-")[0] for f in files[1:]] == ["exp_avg", "exp_avg_sq"]  # after the float32 partition


def test_zero_infinity_swap_buffers_hold_the_largest_partition_of_each_model():
    """DeepSpeed asserts that each parameter partition ZeRO-Infinity swaps in fits one of its buffers. A fixed 4.1e7
    elements (the 1.6B model's tied embedding on 2 ranks, 4.02e7) stopped that model on one process (8.04e7) and GPT-2
    medium and large on one, each with DeepSpeed's assertion and its traceback, and pinned 1.3 GB of host memory
    (float32) for the tiny model. The buffer is now the largest partition of the model DeepSpeed partitions (built here
    on the meta device, as ZeRO-3 pads each parameter to a multiple of the ranks), and the host plan counts them."""
    from transformers import GPT2LMHeadModel

    sizes = {}
    for model, devices in (("1.6b", 1), ("1.6b", 2), ("gpt2-medium", 1), ("tiny", 2), ("small", 3)):
        cfg = gpt.parse_args(["--model", model, "--strategy", "deepspeed_stage_3_offload", "--nvme-path", "/tmp/nvme",
                              "--devices", str(devices), "--accelerator", "cpu", "--micro-batch-size", "1"])
        with torch.device("meta"):
            largest = max(-(-p.numel() // devices) for p in GPT2LMHeadModel(gpt_model.gpt2_config(cfg)).parameters())
        offload = strategies.deepspeed_config(cfg)["zero_optimization"]["offload_param"]
        assert offload["buffer_size"] == largest, (model, devices)
        sizes[model, devices] = offload["buffer_count"] * offload["buffer_size"]
    assert sizes["1.6b", 1] == 8 * 50257 * 1600 > 8 * 4.1e7 > sizes["1.6b", 2] and sizes["tiny", 2] * 4 < 2**20
    tiny = gpt.parse_args(["--model", "tiny", "--strategy", "deepspeed_stage_3_offload", "--nvme-path", "/tmp/nvme",
                           "--devices", "2", "--accelerator", "cpu", "--micro-batch-size", "1",
                           "--precision", "bf16-mixed"])
    device = accounting.device_plan(tiny, on_gpu=False)
    plan = accounting.host_memory_plan(tiny, device["n_params"], device, False, baseline=0.0)
    assert plan["offload"] < 0.6e9  # 1.16 GB before: 0.66 GB of it the parameter buffers of a 0.1M-parameter model


@pytest.mark.slow
def test_pipeline_under_bf16_autocast_equals_one_process(tmp_path):
    """The schedule runs backward itself (autograd.grad), so the stage runs under Fabric's autocast directly."""
    run_gpt(tmp_path, "one", "--micro-batch-size", "4", "--precision", "bf16-mixed", "--steps", "4")
    run_gpt(tmp_path, "pp", "--strategy", "pp", "--devices", "2", "--micro-batch-size", "2", "--grad-accum", "2",
            "--precision", "bf16-mixed", "--steps", "4")
    assert losses(tmp_path, "pp") == pytest.approx(losses(tmp_path, "one"), rel=1e-3)


def test_accumulation_equals_a_larger_batch_in_one_process(single, tmp_path):
    run_gpt(tmp_path, "accum", "--micro-batch-size", "2", "--grad-accum", "2", base=EXACT)
    assert losses(tmp_path, "accum") == pytest.approx(losses(*single), rel=1e-5)
    grads = [n for _, n in record(tmp_path, "accum")["grad_norms"]]
    assert grads == pytest.approx([n for _, n in record(*single)["grad_norms"]], rel=1e-5)


def test_tensor_parallel_conversion_is_exact():
    """Conv1D -> nn.Linear and the head-grouped q,k,v row order: the same outputs, and undone exactly."""
    cfg = gpt.resolve(gpt.Config(model="tiny"))
    model = gpt.build_model(cfg)
    conv = model.transformer.h[0].attn.c_attn
    x = torch.randn(3, 5, cfg.n_embd)
    assert torch.equal(strategies.conv1d_to_linear(conv)(x), conv(x))
    order = strategies.qkv_rows_by_rank(cfg.n_embd, cfg.n_head, 2)
    local = cfg.n_embd // 2
    assert order[:3 * local].tolist() == [*range(0, local), *range(64, 64 + local), *range(128, 128 + local)]
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    tp_layout = dict(sd)
    for i in range(cfg.n_layer):
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            w, b = f"transformer.h.{i}.{name}.weight", f"transformer.h.{i}.{name}.bias"
            tp_layout[w] = sd[w].t()
            if name == "attn.c_attn":
                tp_layout[w], tp_layout[b] = tp_layout[w][order], sd[b][order]
    back = strategies.undo_tensor_parallel(tp_layout, cfg.n_layer, cfg.n_embd, cfg.n_head, 2)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_without_biases_the_model_is_gpt2_with_zero_biases_and_exports_as_gpt2(tmp_path):
    """--no-bias (nanoGPT's bias=False): no bias in any linear layer or LayerNorm, counted so by the model, the plan's
    closed forms and its tensor list; at initialisation GPT-2's biases are zero, so the loss and every shared gradient
    equal GPT-2's; tensor parallelism's Linear has no bias either; and the exported folder is GPT-2's (its biases
    zero), which transformers loads as it is and which computes the same logits."""
    from transformers import AutoModelForCausalLM

    from core.gpt import hf_export
    from core.plan import published

    cfg, biased = gpt.resolve(gpt.Config(model="tiny", bias=False)), gpt.resolve(gpt.Config(model="tiny"))
    model, reference = gpt.build_model(cfg), gpt.build_model(biased)
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if n.endswith(".bias")] and set(names) < {n for n, _ in reference.named_parameters()}
    n = sum(p.numel() for p in model.parameters())
    assert n == gpt.count_parameters(cfg)[0] == published.parameters(cfg) == accounting.memory_plan(cfg, n)["n_params"]
    assert gpt.count_parameters(biased)[0] - n == cfg.n_layer * 11 * cfg.n_embd + cfg.n_embd  # 9h + 2h a block, ln_f's
    tokens = gpt.make_dataset(cfg).tensors[0][:4]
    losses = [gpt_model.window_loss(m, tokens) for m in (model, reference)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for loss in losses:
        loss.backward()
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    conv, x = model.transformer.h[0].mlp.c_fc, torch.randn(3, 5, cfg.n_embd)
    linear = strategies.conv1d_to_linear(conv)
    assert linear.bias is None and torch.equal(linear(x), conv(x))
    folder = hf_export.write_hf_folder(model.state_dict(), cfg, tmp_path / "run" / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert all(loaded.get_parameter(name).abs().max() == 0 for name, _ in reference.named_parameters()
               if name.endswith(".bias"))
    with torch.no_grad():
        ours = model.eval()(input_ids=tokens[:, :-1]).logits
        torch.testing.assert_close(loaded(input_ids=tokens[:, :-1]).logits, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp", "deepspeed_stage_3"])
def test_without_biases_tensor_parallel_and_a_partitioned_build_equal_one_process(tmp_path_factory, name):
    """--no-bias where the model is taken apart: tensor parallelism's Linear layers (and their q,k,v order) and
    ZeRO-3's partitioned build; every step's loss and gradient norm, and the exported weights, equal one process's;
    the traffic counted in a step and the bytes each rank holds equal the plan's."""
    make = lambda out: run_gpt(out, "single", "--micro-batch-size", "4", "--no-bias", base=EXACT)  # noqa: E731
    single = shared_dir(tmp_path_factory, "gpt-single-no-bias", make)
    out = tmp_path_factory.mktemp(f"no-bias-{name}")
    run_gpt(out, name, "--strategy", name, "--devices", "2", *TWO_PROCESS[name], "--no-bias", "--count-comms", base=EXACT)
    ref, got = record(single, "single"), record(out, name)
    assert got["config"]["bias"] is False and got["n_params"] == ref["n_params"]
    assert [l for _, l in got["losses"]] == pytest.approx([l for _, l in ref["losses"]], rel=1e-4)
    assert [g for _, g in got["grad_norms"]] == pytest.approx([g for _, g in ref["grad_norms"]], rel=1e-4)
    w_ref, w_got = exported(single / "single"), exported(out / name)
    assert set(w_got) == set(w_ref) and not w_got["transformer.h.0.attn.c_attn.bias"].any()
    for key in w_ref:
        torch.testing.assert_close(w_got[key], w_ref[key], rtol=1e-4, atol=1e-5, msg=key)
    assert comm_rows(got["comm_counted"]) == comm_rows(got["comm_planned"])
    for key in ("params", "master"):
        assert got["held_bytes"][key] == pytest.approx(got["held_bytes_planned"][key], rel=0.02, abs=1), key


def test_gradient_checkpointing_is_on_and_leaves_loss_and_gradients_unchanged():
    cfg = gpt.resolve(gpt.Config(model="tiny"))
    tokens = gpt.make_dataset(cfg).tensors[0][:4]
    results = []
    for ckpt in (False, True):
        model = gpt.build_model(gpt.dataclasses.replace(cfg, grad_checkpointing=ckpt)).train()
        calls = []
        model.transformer.h[0].attn.register_forward_pre_hook(lambda *a: calls.append(1))
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)))
    (l0, g0, c0), (l1, g1, c1) = results
    assert (c0, c1) == (1, 2)  # checkpointing really recomputes the block in backward
    assert torch.equal(l0, l1)
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_cpu_offload_resumed_from_a_mid_run_checkpoint_gives_the_uninterrupted_run(offload_run, tmp_path):
    """ZeRO-3 offloaded to CPU memory resumes exactly from the whole run's step-4 checkpoint, AdamW's moments
    included (NVMe offload cannot: refused)."""
    whole_out, whole = offload_run("deepspeed_stage_3_offload")
    shutil.copytree(whole_out / whole / "checkpoints" / "step-00000004", tmp_path / "cut" / "checkpoints" / "step-00000004")
    resumed = run_gpt(tmp_path, "cut", "--strategy", "deepspeed_stage_3_offload", *OFFLOAD, "--resume", "auto").stdout
    assert f"resumed from {tmp_path / 'cut' / 'checkpoints' / 'step-00000004'}" in resumed
    assert losses(tmp_path, "cut") == pytest.approx(losses(whole_out, whole), rel=1e-6)


def test_pipeline_stage_recomputes_its_blocks_under_checkpointing():
    """The stages call the blocks directly; transformers' checkpointing lives in each block's forward, so the
    blocks of a stage cut from a checkpointing model recompute in backward, with the same gradients."""
    cfg = gpt.resolve(gpt.Config(model="tiny"))
    tokens = gpt.make_dataset(cfg).tensors[0][:4]
    results = []
    for ckpt in (False, True):
        stage = strategies.pipeline_stage_module(gpt.build_model(gpt.dataclasses.replace(cfg, grad_checkpointing=ckpt)), 0, 2)
        calls = []
        stage.transformer.h["0"].attn.register_forward_pre_hook(lambda *a: calls.append(1))
        stage.train()(tokens).square().mean().backward()
        results.append(({n: p.grad.clone() for n, p in stage.named_parameters()}, len(calls)))
    (g0, c0), (g1, c1) = results
    assert (c0, c1) == (1, 2)
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-5, atol=1e-7)


def run_on_two_nodes(out: Path, name: str, *args, logs: Path) -> str:
    """Two torchrun "machines" of one process each, one shared output folder; both nodes' output."""
    nodes = run_nodes("fabric_gpt.py", *EXACT, "--out-dir", out, "--run-name", name, *args, logs=logs)
    both = "\n".join(nodes)
    # each rank once, each on its own node; one TensorBoard file per start, one record, written by rank 0
    assert both.count("rank 0/2: node 0") == both.count("rank 1/2: node 1") == 1, both[-3000:]
    assert "TorchElasticEnvironment (launcher: torchrun)" in both
    return both


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "deepspeed_stage_3", "fsdp", "tp", "pp"])
def test_resumed_from_a_mid_run_checkpoint_gives_the_uninterrupted_run(two_process, tmp_path, name):
    """The whole run's checkpoints of steps 2 and 4, as a run stopped at step 4 leaves them, resumed in a new
    run folder to the end with activation checkpointing on (it recomputes, so the resumed steps under it must
    equal the whole run without it). Except `tp` (Fabric's own launcher) the resumed run goes over two nodes
    started by torchrun, so its losses also show that two machines equal two processes on one, step by step.
    Under ZeRO-3, rank 1's optimizer shard of step 4 is cut in half: both ranks skip that checkpoint together and
    resume from step 2, and still end exactly where the uninterrupted run ends."""
    whole_out, whole = two_process(name)
    damaged = name == "deepspeed_stage_3"
    for step in ("step-00000002", "step-00000004"):
        shutil.copytree(whole_out / whole / "checkpoints" / step, tmp_path / "cut" / "checkpoints" / step)
    if damaged:
        shard = next((tmp_path / "cut" / "checkpoints" / "step-00000004" / "state").rglob("zero_pp_rank_1_*optim_states.pt"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    if name == "tp":
        args = ["--strategy", name, "--devices", "2", *TWO_PROCESS[name]]
        resumed = run_gpt(tmp_path, "cut", *args, "--resume", "auto", "--grad-checkpointing", base=EXACT).stdout
    else:
        resumed = run_on_two_nodes(tmp_path, "cut", "--strategy", name, *TWO_PROCESS[name], "--resume", "auto",
                                   "--grad-checkpointing", logs=tmp_path / "logs")
        assert len(list((tmp_path / "cut").glob("events.out.tfevents.*"))) == 1
        assert record(tmp_path, "cut")["env"]["launcher"] == "torchrun"
    assert record(tmp_path, "cut")["config"]["grad_checkpointing"]
    start = "step-00000002" if damaged else "step-00000004"
    assert f"resumed from {tmp_path / 'cut' / 'checkpoints' / start}" in resumed
    assert ("skipping checkpoint" in resumed) == damaged
    assert losses(tmp_path, "cut") == pytest.approx(losses(whole_out, whole), rel=1e-6)
    # the resumed process times its own first (cold) steps out: 8 steps run here (10 after the damaged one), 2 of warm-up
    assert record(tmp_path, "cut")["timed_steps"] == (10 if damaged else 8) - 2
    from_checkpoint = strategies.export_checkpoint(tmp_path / "cut" / "checkpoints" / "step-00000012")
    final = exported(whole_out / whole)
    for key in final:  # a sharded checkpoint, read in one process, is one ordinary GPT-2 state dict
        torch.testing.assert_close(from_checkpoint[key], final[key], rtol=1e-4, atol=1e-5, msg=key)
    model = gpt.build_model(gpt.resolve(gpt.Config(model="tiny")))
    missing, unexpected = model.load_state_dict(from_checkpoint, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}


def test_nan_is_caught_every_step_before_any_save(tmp_path):
    """Logging only every 5 steps, checkpointing every step: the NaN stops the run before it is saved."""
    proc = run_gpt(tmp_path, "nan", "--optimizer", "sgd", "--lr", "1e12", "--grad-clip", "0", "--log-every", "5",
                   "--checkpoint-every", "1", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "loss became nan at step 2 (of 12)" in last and "learning rate" in last
    saved = sorted((tmp_path / "nan" / "checkpoints").glob("step-*"))
    assert [p.name for p in saved] == ["step-00000001"]  # step 1's loss was finite, step 2's was not: never saved
    weights = torch.load(saved[0] / "state", weights_only=False)["model"]
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert f"the last good checkpoint is {saved[0]}" in last


@pytest.mark.slow  # a run in a process of its own
def test_sigint_saves_and_resumes_exactly(tmp_path):
    args = [*SMALL, "--num-samples", "4000", "--micro-batch-size", "4", "--checkpoint-every", "200",
            "--out-dir", tmp_path]
    run_in_process("fabric_gpt.py", *args, "--run-name", "whole", "--steps", "60")
    proc = subprocess.Popen([warm_python.executable(), "fabric_gpt.py", *map(str, args), "--run-name", "cut"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("step   20/"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGINT, output
    assert "SIGINT received: saved" in output and "--resume auto" in output
    stopped_at = max(int(p.name[5:]) for p in (tmp_path / "cut" / "checkpoints").glob("step-*"))
    assert 20 <= stopped_at < 60
    run_in_process("fabric_gpt.py", *args, "--run-name", "cut", "--resume", "auto", "--steps", "60")
    assert losses(tmp_path, "cut") == pytest.approx(losses(tmp_path, "whole"), rel=1e-6)  # restored + resumed


FAKE_SCONTROL = """#!/bin/sh
# scontrol for the tests: `show hostnames` names this host; anything else (requeue) is recorded
if [ "$1" = show ]; then echo localhost; exit 0; fi
echo "$@" >> "$SCONTROL_LOG"
"""


def slurm_job(tmp_path, scontrol=True, **ids) -> dict:
    """A SLURM job's environment as a requeue needs it (no srun: Fabric still starts the ranks), with a stand-in
    scontrol that records its arguments."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SLURM_JOB_ID": "4242", **ids, "SCONTROL_LOG": str(tmp_path / "scontrol.log")}
    if scontrol:
        (tmp_path / "bin").mkdir(exist_ok=True)
        (tmp_path / "bin" / "scontrol").write_text(FAKE_SCONTROL)
        (tmp_path / "bin" / "scontrol").chmod(0o755)
        env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    else:
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "scontrol").exists())
    return env


def signal_at_step(args, env, sig, step=20) -> subprocess.CompletedProcess:
    """Start fabric_gpt.py, send `sig` to all its processes once it logs `step`, and wait for its end."""
    proc = subprocess.Popen([warm_python.executable(), "fabric_gpt.py", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    for line in proc.stdout:
        if line.startswith(f"step {step:>4}/"):
            os.killpg(proc.pid, sig)
            break
    output = proc.communicate(timeout=180)[0]
    return subprocess.CompletedProcess(args, proc.returncode, output, "")


@pytest.mark.slow  # 2 processes, three launches
def test_a_slurm_job_signalled_saves_requeues_itself_and_its_rerun_ends_as_the_whole_run(tmp_path):
    """SIGUSR1 in a SLURM job (what #SBATCH --signal=USR1@90 sends): every rank finishes its step and saves, rank 0
    calls `scontrol requeue <job>` once, the job exits 0; the requeued job (same command, --resume auto) ends
    bit for bit where the uninterrupted run ends."""
    two = ["--devices", "2", "--strategy", "ddp", "--micro-batch-size", "2"]
    args = [*SMALL, *two, "--num-samples", "4000", "--checkpoint-every", "200", "--out-dir", tmp_path, "--steps", "40"]
    run_script("fabric_gpt.py", *args, "--run-name", "whole")
    env = slurm_job(tmp_path)
    cut = signal_at_step([*args, "--run-name", "cut", "--resume", "auto"], env, signal.SIGUSR1, step=10)
    assert cut.returncode == 0, cut.stdout[-3000:]
    assert "SIGUSR1 received: saved" in cut.stdout and "requeued SLURM job 4242" in cut.stdout
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # once, by rank 0
    assert 10 <= max(int(p.name[5:]) for p in (tmp_path / "cut" / "checkpoints").glob("step-*")) < 40
    again = subprocess.run([warm_python.executable(), "fabric_gpt.py", *map(str, args), "--run-name", "cut",
                            "--resume", "auto"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr[-2000:]
    assert losses(tmp_path, "cut") == pytest.approx(losses(tmp_path, "whole"), rel=1e-6)


@pytest.mark.slow  # a run in a process of its own
def test_requeue_of_an_array_task_and_without_scontrol(tmp_path):
    """A job array's task is requeued as <array job>_<task>; where scontrol is missing (a container) or refuses, the
    checkpoint is saved all the same, one line says how to requeue by hand, and the exit status is the signal's, not
    0 (SLURM would record the job COMPLETED and nothing would resubmit it); the other requeue signal can be chosen."""
    args = [*SMALL, "--num-samples", "4000", "--checkpoint-every", "200", "--out-dir", tmp_path, "--requeue-signal", "USR2"]
    array = slurm_job(tmp_path, SLURM_ARRAY_JOB_ID="100", SLURM_ARRAY_TASK_ID="3")
    proc = signal_at_step([*args, "--run-name", "array"], array, signal.SIGUSR2, step=5)
    assert proc.returncode == 0 and (tmp_path / "scontrol.log").read_text() == "requeue 100_3\n", proc.stdout[-2000:]
    proc = signal_at_step([*args, "--run-name", "bare"], slurm_job(tmp_path, scontrol=False), signal.SIGUSR2, step=5)
    assert proc.returncode == 128 + signal.SIGUSR2, proc.stdout[-2000:]
    assert "scontrol is not on PATH here, so SLURM job 4242 was not requeued" in proc.stdout
    assert "`scontrol requeue 4242`" in proc.stdout and list((tmp_path / "bare" / "checkpoints").glob("step-*"))
    (tmp_path / "refusing").mkdir()
    refusing = slurm_job(tmp_path / "refusing")
    (tmp_path / "refusing" / "bin" / "scontrol").write_text("#!/bin/sh\necho 'Requeue not permitted' >&2\nexit 1\n")
    proc = signal_at_step([*args, "--run-name", "refused"], refusing, signal.SIGUSR2, step=5)
    assert proc.returncode == 128 + signal.SIGUSR2 and "failed (Requeue not permitted)" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow  # a run in a process of its own
def test_sigusr1_outside_slurm_does_nothing_harmful(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = signal_at_step([*SMALL, "--num-samples", "400", "--out-dir", tmp_path, "--run-name", "plain"], {**env,
                          "PYTHONUNBUFFERED": "1"}, signal.SIGUSR1, step=5)
    assert proc.returncode == 0 and "warning: SIGUSR1 ignored" in proc.stdout
    assert record(tmp_path, "plain")["steps"] == 100  # it trained to the end


def test_explicit_older_resume_abandons_the_newer_branch(tmp_path):
    run_gpt(tmp_path, "r", "--micro-batch-size", "4", "--checkpoint-every", "1", "--keep-last", "10", "--steps", "5")
    (tmp_path / "r" / "checkpoints" / "step-00000009.partial").mkdir()  # a save that never finished
    older = tmp_path / "r" / "checkpoints" / "step-00000002" / "state"
    proc = run_in_process("fabric_gpt.py", *SMALL, "--micro-batch-size", "4", "--checkpoint-every", "1", "--keep-last", "10",
                      "--steps", "3", "--out-dir", tmp_path, "--resume", older)  # no --run-name: found from the path
    assert "resumed from" in proc.stdout and "abandoned" in proc.stdout
    names = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("step-")] == ["step-00000001", "step-00000002", "step-00000003"]
    aside = [p for p in (tmp_path / "r" / "checkpoints").iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step-00000003", "step-00000004",
                                                                                "step-00000005"]


@pytest.mark.slow
def test_zero_checkpoint_on_other_world_size_is_refused(two_process, tmp_path):
    out, name = two_process("deepspeed_stage_2")
    proc = run_script("fabric_gpt.py", *EXACT, "--strategy", "deepspeed_stage_2", "--devices", "1",
                      "--micro-batch-size", "4", "--out-dir", out, "--run-name", name, "--resume", "auto", check=False)
    assert proc.returncode == 1 and "sharded over 2 processes" in proc.stderr.strip().splitlines()[-1]
    # a replicated checkpoint loads anywhere, but on another number of processes the global batch would change
    out, name = two_process("ddp")
    proc = run_in_process("fabric_gpt.py", *EXACT, "--strategy", "ddp", *TWO_PROCESS["ddp"], "--out-dir", out,
                          "--run-name", name, "--resume", "auto", check=False)
    assert proc.returncode == 1 and "ran on 2 processes and this run has 1" in proc.stderr.strip().splitlines()[-1]
    # refused on both processes, having agreed: one line, not one per rank
    proc = run_script("fabric_gpt.py", *EXACT, "--strategy", "ddp", "--devices", "2", *TWO_PROCESS["ddp"],
                      "--out-dir", out, "--run-name", name, "--resume", "auto", "--lr", "1e-3", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "other settings (lr: checkpoint" in errors[0], proc.stderr


# ----------------------------------------------------------------------------- memory plan
def plan_of(**kw):
    cfg = gpt.resolve(gpt.Config(**{"model": "1.6b", "precision": "bf16-mixed", **kw}))
    n, attn = gpt.count_parameters(cfg)
    return cfg, accounting.memory_plan(cfg, n, attn)


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
                                      "deepspeed_stage_3_offload"])
@pytest.mark.parametrize("devices", [1, 8])
def test_plan_model_states_agree_with_deepspeed_estimator(strategy, devices):
    _, plan = plan_of(strategy=strategy, devices=devices)
    ours = plan["params"] + plan["grads"] + plan["optimizer"] + plan["gathered_layer"]
    assert plan["deepspeed_estimate"] is not None
    assert ours == pytest.approx(plan["deepspeed_estimate"], rel=1e-6)


def saved_for_backward(cfg) -> int:
    """Bytes autograd keeps for backward after one forward (storages counted once, parameters left out)."""
    model = gpt.build_model(cfg)
    params, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16-mixed"):
            model(input_ids=tokens, labels=tokens).loss
    return sum(v for k, v in seen.items() if k not in params)


@pytest.mark.parametrize("precision, attention", [("32-true", "auto"), ("bf16-mixed", "autocast"),
                                                  ("bf16-mixed", "float32")])
def test_planned_activations_match_what_autograd_saves(precision, attention):
    """The plan's activations against the bytes saved for backward, measured with saved_tensors_hooks on CPU
    (the plan also counts the loss's gradients, made in backward): within 10%, with attention in bf16 and in float32.
    Checkpointing is left out: its own hooks keep the block inputs where an outer hook cannot see them."""
    cfg = gpt.resolve(gpt.Config(model="small", n_layer=4, seq_len=128, micro_batch_size=2, vocab_size=1000,
                                 precision=precision, accelerator="cpu", attention_precision=attention))
    acts = accounting.activation_bytes(cfg, gpt.count_parameters(cfg)[1])
    planned, measured = acts["activations_full"] - acts["logits_gradient"], saved_for_backward(cfg)
    assert planned == pytest.approx(measured, rel=0.10), (planned / 2**20, measured / 2**20)
    # the tanh GELU runs as one kernel: gelu_new's composite kept 12 more words per element of every block
    word = 4 if precision == "32-true" else 2
    assert measured < planned + 0.5 * cfg.n_layer * cfg.seq_len * cfg.micro_batch_size * cfg.n_embd * 12 * word


def test_plan_divides_by_tp_and_pp_and_reports_the_bubble():
    _, ddp = plan_of(strategy="ddp", devices=8, micro_batch_size=1)
    _, tp = plan_of(strategy="tp", devices=8, micro_batch_size=1)
    _, pp = plan_of(strategy="pp", devices=8, micro_batch_size=1, grad_accum=8)
    _, gpipe = plan_of(strategy="pp", devices=8, micro_batch_size=1, grad_accum=8, pp_schedule="gpipe")
    assert ddp["params"] / 8 < tp["params"] < ddp["params"] / 4  # blocks split 8 ways, embeddings replicated
    assert tp["activations_full"] < ddp["activations_full"] / 2
    assert pp["params"] < ddp["params"] / 4 and pp["bubble_fraction"] == pytest.approx(7 / 15)
    assert gpipe["activations_full"] == pytest.approx(pp["activations_full"])  # m = p = 8: the same in flight
    _, eager = plan_of(strategy="ddp", devices=8, micro_batch_size=1, dropout=0.0)
    assert eager["activations_full"] > 0


@pytest.mark.slow
def test_planned_model_states_match_the_bytes_each_rank_holds(two_process):
    """The plan's parameter, master-weight and optimizer bytes against what each rank's local shards hold."""
    for name, tolerance in (("fsdp", 0.02), ("tp", 0.02), ("pp", 0.02), ("ddp", 0.001), ("deepspeed_stage_1", 0.02),
                            ("deepspeed_stage_2", 0.02), ("deepspeed_stage_3", 0.02)):
        out, run = two_process(name)
        rec = record(out, run)
        cfg = gpt.resolve(gpt.Config(**{k: v for k, v in rec["config"].items() if k in gpt.Config.__dataclass_fields__}))
        n, attn = gpt.count_parameters(cfg)
        plan = accounting.memory_plan(cfg, n, attn)
        for key in ("params", "master"):  # ZeRO-3 shards the weights; ZeRO adds an fp32 master partition
            assert rec["held_bytes"][key] == pytest.approx(plan[key], rel=tolerance, abs=1), (name, key)
        for key, held in rec["held_bytes"].items():  # the record's own plan of the same bytes, as the report shows it
            assert held == pytest.approx(rec["held_bytes_planned"][key], rel=tolerance, abs=1), (name, key)
        # SGD without momentum keeps no state, and the plan says so (AdamW's m and v would be 2x params)
        assert rec["held_bytes"]["optimizer"] == plan["optimizer"] == 0


def test_plan_answers_which_strategy_fits(tmp_path):
    def plan(*args):
        proc = run_in_process("fabric_gpt.py", "--model", "1.6b", "--plan", "--device-memory-gb", "24",
                          "--precision", "bf16-mixed", "--micro-batch-size", "1", *args)
        return proc.stdout

    assert "does NOT fit" in plan("--strategy", "ddp", "--devices", "2")
    fits = plan("--strategy", "deepspeed_stage_3", "--devices", "8", "--grad-checkpointing")
    assert "fits in 24 GiB" in fits and "DeepSpeed's estimator" in fits and "1,557.6M parameters" in fits
    assert "bubble" in plan("--strategy", "pp", "--devices", "4", "--grad-accum", "8")


def test_gpu_peaks_are_dense_and_name_the_variant():
    assert accounting.gpu_chip("NVIDIA H200 NVL") == "h200 nvl"
    assert accounting.PEAK_FLOPS["h200 nvl"]["bf16"] == 835e12
    assert accounting.gpu_chip("NVIDIA H200") == "h200 sxm" and accounting.gpu_chip("NVIDIA H100 PCIe") == "h100 pcie"
    assert accounting.gpu_chip("Tesla T4") is None


# ----------------------------------------------------------------------------- bad input
def test_a_pipeline_takes_a_micro_batch_per_stage_unless_told():
    """`make gpt STRATEGY=pp DEVICES=2` runs: a pipeline's accumulation defaults to its stage count (one micro-batch
    in flight per stage); a --grad-accum given (or its unique prefix, which argparse takes) is kept, and refused
    when below the stage count; other strategies take 1."""
    parse = lambda *a: gpt.parse_args(["--strategy", *a])  # noqa: E731
    assert parse("pp", "--devices", "2").grad_accum == 2 and parse("pp", "--devices", "4", "--pp-size", "2").grad_accum == 2
    assert parse("pp", "--devices", "2", "--grad-accum", "6").grad_accum == 6
    assert parse("pp", "--devices", "2", "--grad-acc=1").grad_accum == 1  # the refusal below then names it
    assert parse("ddp", "--devices", "2").grad_accum == 1 and parse("tp", "--devices", "2").grad_accum == 1


@pytest.mark.parametrize("args,words", [
    (["--strategy", "ddp", "--nvme-path", "/tmp/nvme"], "--nvme-path offloads through DeepSpeed ZeRO-3"),
    (["--strategy", "deepspeed_stage_3_offload", "--nvme-path", "/tmp/nvme", "--resume", "auto"], "moments and step count"),
    (["--devices", "512", "--accelerator", "cpu"], "CPU core(s)"),
    (["--num-samples", "10", "--micro-batch-size", "4"], "not a multiple of the 4 samples per optimizer step"),
    (["--num-samples", "256", "--steps", "100"], "--steps 100 is more than the 64 optimizer steps that --num-samples 256 "
                                                 "holds at 4 samples a step; give --num-samples 400"),
    (["--num-samples", "2000000000", "--accelerator", "cpu"], "GiB of token ids, more than a quarter"),
    (["--n-embd", "30", "--n-head", "4"], "divisible"),
    (["--eval-every", "5"], "--eval-every 5 is read by --dataset text only, not --dataset random"),
    (["--cluster", "h100-sxm"], "--cluster h100-sxm is read by --plan and --search only"),
    (["--device-memory-gb", "10"], "--device-memory-gb 10 is read by --plan and --search only"),
    (["--tokens", "1e9"], "--tokens 1e+09 is read by --plan"),
    (["--export-dtype", "float16"], "add --export"),
    (["--loss-scale-power", "10", "--precision", "32-true"], "--precision 32-true has no loss scaling"),
    (["--optimizer", "sgd", "--beta2", "0.99"], "--beta2 0.99 is AdamW's"),
    (["--compile-scope", "blocks", "--accelerator", "cpu"], "--compile-scope blocks is how --compile compiles"),
    (["--compile-scope", "model", "--no-compile"], "and this run is not compiled; add --compile"),
    (["--strategy", "ddp", "--pp-schedule", "gpipe"], "--pp-schedule gpipe applies to --strategy pp, not ddp"),
    (["--precision", "16-mixed", "--accelerator", "cpu", "--strategy", "deepspeed_stage_2"], "needs a GPU"),
    (["--strategy", "tp", "--devices", "2", "--n-head", "3", "--n-embd", "66"],
     "--tp-size 2 (all 2 processes, as --tp-size is not given) must divide the 3 attention heads"),
    (["--strategy", "tp", "--devices", "2", "--tp-size", "2", "--n-head", "3", "--n-embd", "66"],
     "error: --tp-size 2 must divide the 3 attention heads"),
    (["--strategy", "pp", "--devices", "2", "--n-layer", "1"], "--pp-size 2 (all 2 processes, as --pp-size is not given) is larger"),
    (["--strategy", "fsdp_tp", "--devices", "2", "--tp-size", "4"], "--tp-size 4 must divide the 2 processes"),
    (["--strategy", "ddp", "--tp-size", "2"], "--tp-size applies to --strategy tp or fsdp_tp"),
    (["--strategy", "pp", "--devices", "2", "--pp-size", "3", "--n-layer", "2"], "--pp-size 3 is larger than the 2 layers"),
    (["--strategy", "pp", "--devices", "2", "--pp-size", "2", "--grad-accum", "1"], "needs at least 2 micro-batches"),
    (["--strategy", "deepspeed_stage_2", "--pp-size", "2"], "--pp-size applies to --strategy pp"),
    (["--strategy", "deepspeed_stage_2_offload", "--optimizer", "sgd"], "CPU Adam"),
    (["--num-nodes", "2", "--strategy", "ddp", "--accelerator", "cpu"], "no launcher started this process"),
])
def test_bad_inputs_fail_before_any_model_is_built(tmp_path, monkeypatch, args, words):
    built = []
    monkeypatch.setattr(gpt, "build_model", lambda cfg, fabric=None: built.append(cfg))  # would record any model built
    for launched in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "MASTER_ADDR", "NODE_RANK"):  # as a user's shell
        monkeypatch.delenv(launched, raising=False)
    with pytest.raises(SystemExit) as exit_:
        gpt.main([*args, "--out-dir", str(tmp_path)])
    message = str(exit_.value.code)
    assert message.startswith("error:") and words in message and "\n" not in message, message
    assert not built and not list(tmp_path.iterdir())


def test_pp_size_must_divide_processes():
    cfg = gpt.resolve(gpt.Config(strategy="pp", devices=3, pp_size=2, grad_accum=2, n_layer=4))
    with pytest.raises(gpt.ConfigError, match="--pp-size 2 must divide the 3 processes"):
        layout.check_sizes(cfg)


@pytest.mark.parametrize("args", [["--model", "gpt5"], ["--strategy", "zero4"], ["--precision", "fp8"], ["--steps", "-1"],
                                  ["--nvme-path", "/proc/nvme"]])
def test_unknown_preset_strategy_precision_are_argparse_errors(capsys, args):
    with pytest.raises(SystemExit) as exit_:
        gpt.parse_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"error: {args[0]} must be ") and f"got {args[1]}" in err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        gpt.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for field in gpt.dataclasses.fields(gpt.Config):
        name = field.name.replace("_", "-")
        assert (f"--[no-]{name}" if field.type is bool or field.default is None else f"--{name}") in text
    assert "one of auto, ddp, fsdp, tp, fsdp_tp, pp" in text and "(default: 1234)" in text


# ----------------------------------------------------------------------------- host memory
def test_a_run_whose_host_plan_does_not_fit_is_refused_with_what_would(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(gpt, "build_model", lambda cfg, fabric=None: built.append(cfg))
    with pytest.raises(SystemExit) as exit_:
        gpt.main(["--model", "gpt2", "--accelerator", "cpu", "--micro-batch-size", "8", "--host-memory-gb", "6",
                  "--precision", "32-true", "--out-dir", str(tmp_path)])  # float32 named: its first advice is below
    message = str(exit_.value.code)
    assert message.startswith("error: this run needs about") and "and 6.0 GiB is available" in message, message
    assert "libraries" in message and "Would fit: --micro-batch-size 1" in message and "\n" not in message
    assert not built and not list(tmp_path.iterdir())


class Built(Exception):
    """Training was about to start: the run got past every refusal."""


@pytest.mark.parametrize("args", [
    # the 1.6B model in float32 under ZeRO-Infinity at micro-batch 1: the advice is bf16 and checkpointing
    pytest.param(["--model", "1.6b", "--devices", "2", "--strategy", "deepspeed_stage_3_offload", "--nvme-path", "NVME",
                  "--micro-batch-size", "1", "--num-samples", "4", "--host-memory-gb", "23", "--precision", "32-true"],
                 marks=pytest.mark.slow),  # DeepSpeed's async I/O op is loaded (built, the first time)
    ["--model", "gpt2", "--micro-batch-size", "8", "--host-memory-gb", "6", "--precision", "32-true"],
    ["--model", "gpt2", "--micro-batch-size", "8", "--grad-checkpointing", "--host-memory-gb", "6", "--precision", "32-true"],
])
def test_the_first_advised_command_gets_past_the_refusal(tmp_path, monkeypatch, args):
    """The advice considers every lever the plan knows (precision too), never one in use, and its first command
    passes the host-memory check (it reaches the model's construction). The runs' folders are on a tmpfs of 1 TiB
    (nothing is written to it): the disk plan, which comes first, sees the same room on every machine (CI's disk
    had 43.6 GiB free, less than the 1.6B ZeRO-Infinity run's first checkpoint and NVMe folder)."""
    with sized_disk(tmp_path / "disk", 2**40) as roomy:
        advised_command_gets_past(roomy, monkeypatch, args)


def advised_command_gets_past(tmp_path, monkeypatch, args):
    args = [a.replace("NVME", str(tmp_path / "nvme")) for a in args] + ["--accelerator", "cpu"]
    monkeypatch.setattr(gpt, "find_run", lambda *a: (_ for _ in ()).throw(Built()))  # main() past all its checks
    with pytest.raises(SystemExit) as exit_:
        gpt.main([*args, "--out-dir", str(tmp_path / "a")])
    message = str(exit_.value.code)
    advised = re.search(r"Would fit: ([^(;]+) \(", message)
    assert advised, message
    given = " ".join(args)
    for lever, _ in accounting.HOST_LEVERS:  # never a lever already in use
        assert not (lever.replace(" DIR", "") in given.replace(str(tmp_path / "nvme"), "") and lever in message), lever
    assert not ("--nvme-path" in given and "--nvme-path DIR" in message)
    first = advised.group(1).split()
    first = [str(tmp_path / "nvme2") if f == "DIR" else f for f in first]
    with pytest.raises(Built):  # past the refusal: training would start
        gpt.main([*args, *first, "--out-dir", str(tmp_path / "b")])


@pytest.mark.slow  # a 67M-parameter model's runs
@pytest.mark.parametrize("args, saves", [
    (["--precision", "32-true", "--micro-batch-size", "2"], True),
    (["--precision", "bf16-mixed", "--grad-checkpointing", "--no-save-at-end", "--micro-batch-size", "2"], False)],
    ids=["float32-its-save", "bf16-checkpointed-training"])
def test_host_plan_against_the_measured_peak_of_a_run(tmp_path, args, saves):
    """GPT-2 small's width and vocabulary with 4 blocks (67M parameters) on one CPU process: the plan's host peak
    (the libraries measured at start, then the larger of building, training and saving) against the process's peak
    resident memory, within the margin the refusal keeps for the plan's error (5%). In float32 at this shape the
    vocabulary outweighs the activations: training's peak is the end of its backward, where the tied embedding's
    gradient is summed out of place (accounting.tied_gradient_sum). That run saves its 0.8 GB checkpoint at its end,
    written in place (checkpoints.WrittenInPlace): the save adds nothing to the peak (Lightning's own save serialized
    a second copy of the states into memory, a peak 17% over this plan), and it needs no room in the system's
    temporary folder (TMPDIR is a tmpfs of 1 MiB; Lightning's staged the whole file there). The second run saves
    nothing: training's term with autocast copies and checkpointed blocks. On a CPU without bf16 instructions
    (emulated bf16 matmuls, 90x slower than float32 on an AVX2 EPYC) it takes one window of 32 tokens and a vocabulary
    of 4,096 (7 minutes a step otherwise)."""
    if "bf16-mixed" in args and not hardware.native_bf16():
        args = [*args[:-1], "1", "--seq-len", "32", "--vocab-size", "4096"]
    with sized_disk(tmp_path / "tmp", 2**20) as small_tmp:
        proc = run_script("fabric_gpt.py", "--model", "gpt2", "--n-layer", "4", "--seq-len", "128", *args,
                          "--num-samples", "16", "--steps", "2", "--accelerator", "cpu", "--out-dir", tmp_path,
                          "--run-name", "host", cold=True, env={"TMPDIR": str(small_tmp)})
    rec = record(tmp_path, "host")
    plan, measured = rec["host_plan"], rec["memory"]["max_rss_gb"] * 2**30
    planned = plan["per_process"] if saves else plan["baseline"] + plan["training"]
    assert planned == pytest.approx(measured, rel=accounting.HOST_PLAN_MARGIN), (planned / 2**30, measured / 2**30)
    assert plan["checkpoint"] < plan["training"]  # the states are saved as they are held
    if saves:  # written whole where the run's disk is
        assert (tmp_path / "host" / "checkpoints" / "step-00000002" / "state").stat().st_size > 2**29
    # the summary reads the peak against this plan, not against the device plan's states alone
    assert f"host {plan['per_process'] / 2**30:.3g} a process (libraries {plan['baseline'] / 2**30:.3g}" in proc.stdout


@pytest.mark.slow  # two real ranks of a 30M-parameter model
def test_zero3_host_plan_on_two_ranks_against_the_measured_peak(tmp_path):
    """ZeRO-3 on 2 CPU ranks (384 wide, 6 blocks, 30M parameters, float32, fresh interpreters): rank 0's planned host
    peak against its peak resident memory, within the refusal's margin. Its terms beyond the partition
    (accounting.zero3_on_cpu): the gradients twice (DeepSpeed's bucket as far as they fill it, and reduce-scatter's
    concatenated copy), those autograd made and freed into the heap, the parameters kept gathered. The bucket's
    2e8 elements are made with torch.empty and never resident whole: counted whole (0.75 GiB) they planned this run
    25% over its peak, past the margin."""
    run_script("fabric_gpt.py", "--model", "gpt2", "--n-embd", "384", "--n-head", "6", "--n-layer", "6", "--seq-len",
               "256", "--micro-batch-size", "2", "--precision", "32-true", "--strategy", "deepspeed_stage_3",
               "--devices", "2", "--num-samples", "8", "--steps", "2", "--no-save-at-end", "--accelerator", "cpu",
               "--out-dir", tmp_path, "--run-name", "z3", cold=True)
    rec = record(tmp_path, "z3")
    plan, measured = rec["host_plan"], rec["memory"]["max_rss_gb"] * 2**30
    assert plan["per_process"] == pytest.approx(measured, rel=accounting.HOST_PLAN_MARGIN), (plan, measured / 2**30)


LOSS_PEAK = """
import resource, sys, psutil, torch, torch.nn.functional as F
N, V, H = 1024, 50257, 8
hidden, head = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
targets = torch.randint(0, V, (N,))
def loss(n):  # as transformers' causal-LM loss: the logits in the run's word, then in float32 into cross_entropy
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=sys.argv[1] == "bf16"):
        logits = hidden[:n] @ head.T
    return F.cross_entropy(logits.float(), targets[:n])
loss(8).backward()  # kernels and allocator warm, on a few rows
hidden.grad = head.grad = None
before = psutil.Process().memory_info().rss
loss(N).backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) / (N * V))
"""


@pytest.mark.parametrize("word", ["bf16", "float32"])
def test_the_loss_peak_is_planned_at_its_bytes_a_logit_whatever_the_logits_word(tmp_path, word):
    """The loss's peak, in its backward: log_softmax's float32 output, nll_loss's float32 gradient of it and the
    logits' float32 gradient at once, in a fresh interpreter (the kernel's high-water mark of resident memory over
    what the process held before): the plan's bytes a logit within 10%, with bf16 logits as with float32 ones. A
    16-bit run had been planned at 10 (the logits' own word plus two float32 tensors): 11-12% under the peak of
    GPT-2 small's width at micro-batch 4 and sequence 1024 on 1 or 2 ranks (docs/gpt.md)."""
    script = tmp_path / "loss_peak.py"
    script.write_text(LOSS_PEAK)
    per_logit = float(run_script(script, word, cold=True).stdout.split()[-1])
    assert per_logit == pytest.approx(accounting.LOSS_BYTES_PER_LOGIT, rel=0.10), per_logit


FAKE_SRUN = """#!/bin/bash
# srun on one host, for the tests: SLURM_NTASKS tasks, each with the variables srun gives it and, as slurmstepd
# starts them, in a process group of its own (its id in task<i>.pgid: where SLURM's signals go). The venv's python
# becomes SRUN_PYTHON, the warm python every other process of the suite starts from (warm_python.py)
while [[ $1 == -* ]]; do shift; done
[[ -n $SRUN_PYTHON && $1 == */python ]] && set -- "$SRUN_PYTHON" "${@:2}"
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$((i % SLURM_NTASKS_PER_NODE)) SLURM_NODEID=$((i / SLURM_NTASKS_PER_NODE)) \\
    setsid "$@" > "$SRUN_LOGS/task$i.log" 2>&1 &
  pids+=($!)
  echo $! > "$SRUN_LOGS/task$i.pgid"
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""


def sbatch_job(tmp_path, ntasks: int, settings: dict) -> dict:
    """gpt.sbatch's environment as sbatch gives it on the first node of `--nodes <ntasks> --ntasks-per-node 1`, with
    the stand-in srun above and a stand-in scontrol that records its arguments (slurm_job)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    slurm = {"SLURM_JOB_ID": "31337", "SLURM_JOB_NAME": "fabric-gpt", "SLURM_JOB_NUM_NODES": str(ntasks),
             "SLURM_NNODES": str(ntasks), "SLURM_NTASKS": str(ntasks), "SLURM_NTASKS_PER_NODE": "1",
             "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost", "SLURM_SUBMIT_DIR": str(REPO)}
    env = {k: v for k, v in slurm_job(tmp_path).items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # `make test`
    return {**env, **slurm, **settings, "PATH": f"{bin_dir}:{env['PATH']}", "SRUN_LOGS": str(tmp_path),
            "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "SRUN_PYTHON": warm_python.executable()}


def signal_tasks_at(tmp_path, proc, pattern: str, sig, ntasks: int = 1, times: int = 2, timeout: float = 300) -> None:
    """Once task 0's log matches `pattern`, send `sig` to every task's process group, `times` times in a row."""
    deadline = time.time() + timeout
    log = tmp_path / "task0.log"
    while not (log.exists() and re.search(pattern, log.read_text(), re.M)):
        assert proc.poll() is None and time.time() < deadline, f"never saw {pattern!r}: " + (
            log.read_text()[-2000:] if log.exists() else "no log")
        time.sleep(0.01)
    for _ in range(times):
        for i in range(ntasks):
            os.killpg(int((tmp_path / f"task{i}.pgid").read_text()), sig)
        time.sleep(0.05)


@pytest.mark.slow
def test_the_slurm_batch_script_survives_its_signal_and_trains_on_two_nodes_as_two_processes_do(two_process, tmp_path):
    """gpt.sbatch read as SLURM reads it (one task per GPU) and run as sbatch runs it on the first node of
    `sbatch --nodes 2 --ntasks-per-node 1`, with an srun that starts the 2 tasks here with srun's variables, each in
    its own process group: Fabric picks its SLURM environment with those ranks. SIGUSR1 to both tasks' process groups,
    twice in a row while they set up (as SLURM's --signal delivers it): every rank saves at its first step boundary,
    rank 0 requeues the job once, the tasks exit 0. The job run again (requeued) continues from that checkpoint, and
    the run equals the 2-process run step by step."""
    script = (REPO / "gpt.sbatch").read_text()
    out = tmp_path / "Juliet's runs"  # a space and an apostrophe: the command passes through make and a shell
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.M))
    assert directives["nodes"] == "1" and directives["ntasks-per-node"] == directives["gpus-per-node"] == "2"
    (srun,) = [line for line in script.splitlines() if "srun " in line and not line.startswith("#")]
    assert srun == 'eval "srun --kill-on-bad-exit=1 $command"'  # the Python processes themselves: no make to die on USR1
    assert 'gpt-command NODES="$SLURM_JOB_NUM_NODES" DEVICES="$SLURM_NTASKS_PER_NODE"' in script
    settings = {"MODEL": "tiny", "STRATEGY": "ddp", "PRECISION": "32-true", "STEPS": "0", "ACCELERATOR": "cpu",
                "RUN": "slurm", "ARGS": shlex.join(map(str, [*EXACT, *TWO_PROCESS["ddp"], "--out-dir", out]))}
    env = sbatch_job(tmp_path, 2, settings)
    proc = subprocess.Popen(["bash", "gpt.sbatch"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    signal_tasks_at(tmp_path, proc, r"^config: ", signal.SIGUSR1, ntasks=2)
    first = proc.communicate(timeout=600)[0]
    tasks = [(tmp_path / f"task{i}.log").read_text() for i in range(2)]
    assert proc.returncode == 0, first[-2000:] + tasks[0][-3000:]
    assert "SIGUSR1 received: saved" in tasks[0] and "requeued SLURM job 31337" in tasks[0], tasks[0][-2000:]
    # each rank acknowledges the signal it got, naming itself (rank 0 had joined the group: it had printed its config)
    assert re.search(r"^\[rank: 0\] SIGUSR1 received: stopping", tasks[0], re.M), tasks[0][-2000:]
    assert re.search(r"^(\[rank: 1\] )?SIGUSR1 received: stopping", tasks[1], re.M), tasks[1][-2000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 31337\n"  # once, by rank 0
    assert list((out / "slurm" / "checkpoints").glob("step-*")) and not (out / "slurm" / "record.json").exists()
    again = subprocess.run(["bash", "gpt.sbatch"], cwd=REPO, env={**env, "MASTER_PORT": str(free_port())},
                           capture_output=True, text=True, timeout=600)
    tasks = [(tmp_path / f"task{i}.log").read_text() for i in range(2)]
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:] + tasks[0][-3000:]
    assert "resumed from" in tasks[0]
    for rank in range(2):
        assert re.search(rf"^rank {rank}/2: node {rank}, local rank 0, .*SLURMEnvironment \(launcher: SLURM \(srun\)\)",
                         tasks[rank], re.M), tasks[rank][-2000:]
    got = record(out, "slurm")
    assert got["world_size"] == 2 and got["config"]["num_nodes"] == 2 and got["env"]["launcher"] == "SLURM (srun)"
    assert losses(out, "slurm") == pytest.approx(losses(*two_process("ddp")), rel=1e-6)


@pytest.mark.slow
def test_sigterm_twice_during_a_periodic_save_keeps_that_checkpoint_and_takes_no_further_step(tmp_path):
    """SLURM's preemption and time limit send SIGTERM to the task's process group; a launcher forwards it again. The
    pair, sent as a periodic checkpoint is being written: the run stops with that checkpoint as its last (no further
    step, no second save), exits 143, requeues nothing, and a second run continues it to the end."""
    steps = ["--model", "tiny", "--n-embd", "512", "--n-layer", "4", "--seq-len", "32", "--micro-batch-size", "8",
             "--num-samples", "144", "--checkpoint-every", "6", "--log-every", "6", "--out-dir", tmp_path]
    settings = {"STEPS": "0", "MODEL": "tiny", "STRATEGY": "auto", "PRECISION": "32-true", "ACCELERATOR": "cpu",
                "RUN": "term", "ARGS": " ".join(map(str, [*steps[2:], "--dataset", "ramp"]))}
    env = sbatch_job(tmp_path, 1, settings)
    proc = subprocess.Popen(["bash", "gpt.sbatch"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    signal_tasks_at(tmp_path, proc, r"^step   12/", signal.SIGTERM, times=1)  # its log line comes just before its save
    # the second once the first is acknowledged (a handler runs between two C calls of the save): two signals that
    # land in one C call reach Python as one
    # (anywhere in a line: a fresh clone's run once wrote it between the step line's text and its newline)
    signal_tasks_at(tmp_path, proc, r"SIGTERM received: stopping", signal.SIGTERM, times=1)
    proc.communicate(timeout=600)
    log = (tmp_path / "task0.log").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    saved = sorted(p.name for p in (tmp_path / "term" / "checkpoints").glob("step-*"))
    assert saved[-1] == "step-00000012" and "SIGTERM received: saved" in log and "SIGTERM received again" in log, saved
    assert not (tmp_path / "scontrol.log").exists()
    again = subprocess.run(["bash", "gpt.sbatch"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and record(tmp_path, "term")["steps"] == 18, again.stderr[-2000:]


# ----------------------------------------------------------------------------- what a run says before and after
def test_a_run_that_outruns_its_cached_matmul_peak_drops_it(tmp_path, monkeypatch):
    """The CPU's matmul peak is measured once and cached: one measured while another job loaded the cores would make
    every later MFU too high. A run that outruns it (here a peak of 1 GFLOP/s, cached as if so measured) says so, and
    drops it; the next run measures the peak again and its MFU is a share."""
    monkeypatch.setenv("FABRIC_LAB_CACHE", str(tmp_path / "cache"))
    settings = accounting.matmul_peak_settings("32-true")
    measurements.cached_unlocked("matmul_peak", settings, lambda: [1e9, "float32 matmul"])
    proc = run_gpt(tmp_path, "outrun", "--steps", "4", "--precision", "32-true")
    assert record(tmp_path, "outrun")["mfu"] > 1 and "the next run measures it again" in proc.stdout, proc.stdout
    assert measurements.cached("matmul_peak", settings, None, allow_measure=False) is None
    run_gpt(tmp_path, "again", "--steps", "4", "--precision", "32-true")
    assert 0 < record(tmp_path, "again")["mfu"] <= 1
    assert measurements.cached("matmul_peak", settings, None, allow_measure=False)[0] > 1e9


def test_a_cache_it_cannot_keep_costs_a_measurement_not_the_run(tmp_path, monkeypatch):
    """A home that cannot hold ~/.cache (read-only, or missing: a container's, a cluster's): the run measures what it
    needs (the matmul peak, --precision auto's step, the GELU), says once that nothing is kept, and trains; it ended
    in NotADirectoryError before its first step."""
    monkeypatch.setenv("FABRIC_LAB_CACHE", "/dev/null/cache")
    proc = run_gpt(tmp_path, "uncached", "--steps", "2", "--precision", "auto")
    assert proc.stderr.count("note: measurements are not kept in /dev/null/cache (Not a directory)") == 1, proc.stderr
    assert record(tmp_path, "uncached")["steps"] == 2


def test_a_short_run_counts_its_own_steps_and_says_it_was_not_timed(tmp_path):
    """--steps 2 with the default warm-up of 2: progress counts to 2 (not the schedule's 12), and the summary says
    why there is no step time instead of printing NaN; record.json holds null."""
    proc = run_gpt(tmp_path, "short", "--steps", "2")
    assert "step    1/2 |" in proc.stdout and "step    2/2 |" in proc.stdout and "/12 |" not in proc.stdout
    assert "not timed: 2 steps here, all of them warm-up (--timing-warmup 2)" in proc.stdout and "nan" not in proc.stdout
    raw = (tmp_path / "short" / "record.json").read_text()
    rec = json.loads(raw)
    assert rec["step_time_s"] is None and rec["tokens_per_s"] is None and rec["mfu"] is None and "NaN" not in raw


@pytest.mark.parametrize("seq_len,said", [(100_000, True), (64, False)])
def test_a_run_planned_over_a_minute_says_so_before_its_first_step(seq_len, said, capsys):
    """The performance model's step at this machine's measured matmul peak, times the steps to run."""
    from lightning.fabric import Fabric

    cfg = gpt.resolve(gpt.Config(model="tiny", seq_len=seq_len, steps=2, accelerator="cpu"))
    fabric = Fabric(accelerator="cpu", devices=1)
    peak = gpt.accounting.peak_flops(fabric.device, cfg.precision)
    gpt_figures.announce_duration(fabric, cfg, gpt.count_parameters(cfg)[0], peak, 2)
    out = capsys.readouterr().out
    assert ("planned: about " in out and "for 2 steps" in out and "Ctrl-C stops cleanly" in out) == said, out


# ----------------------------------------------------------------------------- Lightning's launcher
@pytest.mark.slow
def test_fabric_run_launches_the_script_as_its_own_launch_does(two_process, tmp_path):
    """`fabric run --accelerator cpu --devices 2 --strategy ddp fabric_gpt.py ...`: the launcher's settings become the
    script's, and the run equals the script's own 2-process ddp run step by step."""
    out, name = two_process("ddp")
    args = [*EXACT, *TWO_PROCESS["ddp"], "--count-comms", "--checkpoint-every", "2", "--keep-last", "6"]
    proc = subprocess.run([warm_python.executable(), Path(warm_python.REAL).with_name("fabric"), "run",
                           "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp", "fabric_gpt.py",
                           *map(str, args), "--out-dir", tmp_path, "--run-name", "fabric-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = record(tmp_path, "fabric-run")
    assert got["world_size"] == 2 and got["config"]["strategy"] == "ddp" and got["env"]["launcher"] == "torchrun"
    assert losses(tmp_path, "fabric-run") == pytest.approx(losses(out, name), rel=1e-6)


def test_a_flag_that_contradicts_fabric_run_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LT_CLI_USED", "1")
    monkeypatch.setenv("LT_DEVICES", "2")
    monkeypatch.setattr(gpt, "build_model", lambda cfg, fabric=None: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as exit_:
        gpt.main(["--devices", "1", "--accelerator", "cpu", "--out-dir", str(tmp_path)])
    assert str(exit_.value.code) == ("error: --devices 1 conflicts with `fabric run --devices 2`, which launched this "
                                     "process: give --devices in one place (the launcher's decides how many processes "
                                     "start)")
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- a model others load
@pytest.mark.slow  # reads the 2-process runs
@pytest.mark.parametrize("name", ["tp", "pp", "deepspeed_stage_3"])
def test_make_export_writes_a_folder_transformers_loads(single, two_process, name, tmp_path):
    """`make export RUN=<run>` on a sharded run's checkpoint: a folder AutoModelForCausalLM loads with no missing or
    unexpected keys, whose logits are the checkpoint's model's (float32, 1e-5) and whose weights equal the
    one-process run's export."""
    from transformers import AutoModelForCausalLM

    from core.gpt import hf_export

    out, run = two_process(name)
    shutil.copytree(out / run / "checkpoints", tmp_path / run / "checkpoints")
    folder = hf_export.main([str(tmp_path / run)])
    assert folder == tmp_path / run / "hf" and {"config.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in folder.iterdir()}
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    newest = sorted((tmp_path / run / "checkpoints").glob("step-*"))[-1]
    trained = gpt.build_model(gpt.resolve(gpt.Config(model="tiny")))
    trained.load_state_dict(strategies.export_checkpoint(newest), strict=False)
    trained.tie_weights()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens).logits, trained.eval()(tokens).logits, rtol=0, atol=1e-5)
    one = exported(single[0] / single[1])
    got = exported(tmp_path / run)
    assert set(got) == set(one)
    for key in one:
        torch.testing.assert_close(got[key], one[key], rtol=1e-4, atol=1e-5, msg=key)


def test_export_of_a_run_without_checkpoint_is_one_line(tmp_path, capsys):
    from core.gpt import hf_export

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_:
        hf_export.main([str(tmp_path / "empty")])
    assert str(exit_.value.code).startswith(f"error: {tmp_path / 'empty'} has no complete checkpoint to export")


def test_resume_auto_on_a_finished_gpt_run_trains_no_more(tmp_path):
    """A requeued job that already finished: --resume auto sees the record reached --steps and exits 0 untouched;
    asked for more steps, the same command continues it."""
    first = run_gpt(tmp_path, "done", "--steps", "3", "--resume", "auto")
    assert "has no checkpoint yet: starting the run" in first.stdout and record(tmp_path, "done")["steps"] == 3
    again = run_gpt(tmp_path, "done", "--steps", "3", "--resume", "auto")
    assert "has finished (its record.json holds step 3); nothing to train" in again.stdout and "loss" not in again.stdout
    more = run_gpt(tmp_path, "done", "--steps", "5", "--resume", "auto")
    assert "resumed from" in more.stdout and record(tmp_path, "done")["steps"] == 5


def test_a_runs_samples_are_a_whole_number_of_steps_and_its_steps_worth(tmp_path):
    """Without --num-samples a run took 256 samples: `make gpt ACCUM=3` (12 a step) was refused for a flag nobody gave,
    and `make gpt STEPS=100` trained 64 steps, all that 256 held, without a word. Now the default is whole steps, at
    least --steps' worth; a larger --steps extends a run over the same first samples; --resume without --steps keeps
    the run's own (a run of 70 steps is finished, not refused for 256 samples against its 280)."""
    for argv, per_step in ((["--grad-accum", "3"], 12), (["--micro-batch-size", "3"], 3), (["--micro-batch-size", "300"], 300),
                           (["--micro-batch-size", "5", "--grad-accum", "7"], 35)):
        cfg = gpt.parse_args(argv)
        assert cfg.num_samples == max(1, 256 // per_step) * per_step, argv  # 252, 255, 300, 245
    assert gpt.schedule_steps(gpt.parse_args(["--steps", "100"])) == (100, 100)
    for dataset in ("random", "ramp"):  # the first samples of a larger set are the smaller set
        cfg = gpt.parse_args(["--dataset", dataset])
        small, large = (gpt.make_dataset(dataclasses.replace(cfg, num_samples=n)).tensors[0] for n in (256, 1000))
        assert torch.equal(small, large[:256])
    base = ["--model", "tiny", "--dataset", "ramp", "--n-layer", "1", "--seq-len", "16", "--accelerator", "cpu",
            "--precision", "32-true", "--log-every", "35", "--no-save-at-end"]
    run_gpt(tmp_path, "long", "--steps", "70", "--checkpoint-every", "70", base=base)
    assert (record(tmp_path, "long")["steps"], record(tmp_path, "long")["config"]["num_samples"]) == (70, 280)
    done = run_gpt(tmp_path, "long", "--resume", "auto", base=base)
    assert "has finished (its record.json holds step 70)" in done.stdout, done.stdout[-2000:]
    more = run_gpt(tmp_path, "long", "--steps", "72", "--resume", "auto", base=base)
    assert "steps 71-72 past its schedule of 70 (the learning rate stays at the schedule's end)" in more.stdout
    assert record(tmp_path, "long")["steps"] == 72


def test_a_checkpoint_resumed_into_another_out_dir_keeps_its_runs_settings(tmp_path):
    """--resume PATH with another --out-dir: --precision auto and the sample count come from the run that saved the
    checkpoint (the config.json beside its checkpoints), as for --resume auto. They were looked for under the new
    --out-dir, where nothing was yet: the precision was measured anew, and 256 samples refused against the run's 280."""
    base = ["--model", "tiny", "--dataset", "ramp", "--n-layer", "1", "--seq-len", "16", "--accelerator", "cpu",
            "--log-every", "35", "--no-save-at-end"]
    run_gpt(tmp_path / "a", "x", "--steps", "70", "--checkpoint-every", "35", base=base)
    moved = run_gpt(tmp_path / "b", "x", "--resume", tmp_path / "a" / "x" / "checkpoints" / "step-00000035", base=base)
    precision = record(tmp_path / "a", "x")["config"]["precision"]  # what the probe chose on this CPU
    assert f"precision auto: {precision} (the precision the resumed run trained in" in moved.stdout, moved.stdout[-2000:]
    assert "steps 36-70 of 70" in moved.stdout and record(tmp_path / "b", "x")["config"]["num_samples"] == 280


def test_mfu_of_a_bf16_run_without_bf16_instructions_is_a_share(tmp_path):
    """Without bf16 instructions (this CPU's own lack, or the AVX2 caps, which imitate it where they are), the bf16
    matmul probe alone runs ~1 GFLOP/s while the model's addmm runs far faster: the peak is the best path measured,
    named in the record, and the utilization lies in [0, 1]. The caps are set only where the CPU has bf16
    instructions: they are read at load, so they cost a real interpreter (9 s of imports on an AVX2 EPYC)."""
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"} if hardware.native_bf16() else {}
    run_script("fabric_gpt.py", "--model", "tiny", "--n-embd", "32", "--n-layer", "1", "--seq-len", "32",
               "--precision", "bf16-mixed", "--accelerator", "cpu", "--steps", "4", "--timing-warmup", "1",
               "--num-samples", "64", "--out-dir", tmp_path, "--run-name", "caps", env=env)
    rec = record(tmp_path, "caps")
    assert 0 < rec["mfu"] <= 1, rec["mfu"]
    assert rec["peak_flops_source"].startswith("measured CPU matmul probe, best of bf16 addmm, bf16 matmul")


# ----------------------------------------------------------------------------- host reads
def per_step_reads(monkeypatch, tmp_path, *flags) -> dict:
    """Reads that a run of 8 steps makes beyond a run of 4 (one log point, at the end, in both)."""
    common = ["--model", "tiny", "--n-embd", "64", "--n-layer", "2", "--n-head", "2", "--seq-len", "32", "--accelerator",
              "cpu", "--num-samples", "64", "--micro-batch-size", "4", "--log-every", "1000", "--out-dir", tmp_path, *flags]
    short = host_reads(monkeypatch, gpt, *common, "--steps", "4", "--run-name", "short")
    long = host_reads(monkeypatch, gpt, *common, "--steps", "8", "--run-name", "long")
    return {k: long.get(k, 0) - short.get(k, 0) for k in {*short, *long} if long.get(k, 0) != short.get(k, 0)}


def test_a_gpt_step_reads_no_device_value_between_log_points(tmp_path, monkeypatch):
    """No host sync in a step, eager: the loss, the gradient norm and the non-finite check stay on the device until a
    log point, an evaluation or a checkpoint, and the attention (gpt_model.SDPA_CAUSAL) builds no mask, so
    transformers' packed-sequence check (masking_utils.find_packed_sequence_indices, one read per forward under
    "sdpa") never runs; with gradient accumulation too."""
    assert per_step_reads(monkeypatch, tmp_path) == {}
    assert per_step_reads(monkeypatch, tmp_path / "accum", "--grad-accum", "2") == {}


@pytest.mark.slow
def test_compiled_steps_read_nothing_and_match_eager(tmp_path, monkeypatch):
    """--compile, by blocks (each compiled in place: the blocks of both runs, 2 each, share one graph) and as one
    model: the step reads no device value, the losses are eager's, and the checkpoint's keys are the eager model's.
    --compile-scope auto is blocks on a GPU, the model on a CPU. ZeRO-3 is refused (its hooks, run inside the
    compiled code, recompiled per module past dynamo's limit: measured on 2 processes, both scopes)."""
    from torch._dynamo.utils import counters

    per_step_reads(monkeypatch, tmp_path / "eager")
    eager = json.loads((tmp_path / "eager" / "long" / "record.json").read_text())
    state = lambda d: torch.load(tmp_path / d / "long" / "checkpoints" / "step-00000008" / "state",  # noqa: E731
                                 weights_only=False)["model"]
    for scope in ("blocks", "model"):
        graphs = counters["stats"]["unique_graphs"]
        assert per_step_reads(monkeypatch, tmp_path / scope, "--compile", "--compile-scope", scope) == {}
        assert scope == "model" or counters["stats"]["unique_graphs"] - graphs == 1
        compiled = json.loads((tmp_path / scope / "long" / "record.json").read_text())
        assert compiled["config"]["compile_scope"] == scope
        assert compiled["losses"][-1][1] == pytest.approx(eager["losses"][-1][1], rel=1e-4)
        assert sorted(state(scope)) == sorted(state("eager")) and "transformer.h.1.attn.c_attn.weight" in state(scope)
    assert [gpt.resolve(gpt.Config(compile=True, accelerator=a)).compile_scope for a in ("cpu", "cuda")] == [
        "model", "blocks"]
    for scope in ("blocks", "model"):
        with pytest.raises(gpt.ConfigError, match="--compile with ZeRO-3: DeepSpeed's hooks"):
            gpt.validate(gpt.resolve(gpt.Config(strategy="deepspeed_stage_3", devices=2, compile=True,
                                                compile_scope=scope)))


def test_a_nan_between_log_points_is_named_by_its_step_and_never_saved(tmp_path):
    """The non-finite check is read at log points and before saves only: the NaN of step 2 stops the run at the
    next check point (step 5), whose message names step 2, with nothing saved."""
    proc = run_gpt(tmp_path, "nan", "--optimizer", "sgd", "--lr", "1e12", "--grad-clip", "0", "--log-every", "5",
                   "--checkpoint-every", "5", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "loss became nan at step 2 (of 12)" in last and "no checkpoint was saved" in last
    assert not list((tmp_path / "nan").glob("checkpoints/step-*"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, micro", [("tp", "2"), ("fsdp", "1")])
def test_clipping_on_the_device_equals_one_process(tmp_path, strategy, micro):
    """AdamW with --grad-clip 1 where the gradient norm is above 1: clipping by min(1, max/norm) on the device, on
    DTensor gradients (tp, fsdp), gives the single process's losses (Fabric's clip_grad_norm_ there)."""
    common = ["--lr", "1e-2", "--log-every", "1", "--grad-clip", "1"]
    run_gpt(tmp_path, "one", *common, "--micro-batch-size", "2")
    run_gpt(tmp_path, strategy, *common, "--strategy", strategy, "--devices", "2", "--micro-batch-size", micro)
    one, many = (json.loads((tmp_path / n / "record.json").read_text()) for n in ("one", strategy))
    assert max(n for _, n in one["grad_norms"]) > 1.5  # clipping was at work
    assert [loss for _, loss in many["losses"]] == pytest.approx([loss for _, loss in one["losses"]], rel=1e-4)
    assert [n for _, n in many["grad_norms"]] == pytest.approx([n for _, n in one["grad_norms"]], rel=1e-3)


@pytest.mark.slow
def test_two_dimensional_mesh_norm_is_one_call_per_dimension(single, tmp_path):
    """fsdp_tp on 4 processes, 2 data-parallel x 2 tensor-parallel (the only layout where a gradient is sharded over
    two mesh dimensions; 4 torchrun nodes of one process, as this machine has 2 cores): losses and gradient norms
    equal one process's, and the norm's squares cross each dimension in one all-reduce (16 bytes over data parallel,
    8 over tensor parallel), as the plan counts."""
    run_nodes("fabric_gpt.py", *EXACT, "--out-dir", tmp_path, "--run-name", "2d", "--strategy", "fsdp_tp",
              "--tp-size", "2", "--micro-batch-size", "2", "--count-comms", logs=tmp_path / "logs", nnodes=4)
    ref, got = record(*single), record(tmp_path, "2d")
    assert [l for _, l in got["losses"]] == pytest.approx([l for _, l in ref["losses"]], rel=1e-4)
    assert [n for _, n in got["grad_norms"]] == pytest.approx([n for _, n in ref["grad_norms"]], rel=1e-4)
    norms = [r for r in got["comm_counted"] if r["kind"] == "all_reduce" and r["bytes"] in (8, 16)]
    assert sorted((r["group_size"], r["bytes"], r["count"]) for r in norms) == [(2, 8, 1), (2, 16, 1)]
    assert comm_rows(got["comm_counted"]) == comm_rows(got["comm_planned"])


@pytest.mark.slow
def test_fsdp_gathers_blocks_in_bf16_under_bf16_mixed(tmp_path):
    """Under bf16-mixed FSDP2 all-gathers the blocks in bf16 (half the float32 bytes, counted as planned) and
    reduces gradients in float32; it trains as one process under autocast does, to bf16's rounding (inside a block
    the residual stream is bf16 here)."""
    common = ["--precision", "bf16-mixed", "--steps", "6", "--log-every", "1"]
    run_gpt(tmp_path, "one", *common, "--micro-batch-size", "4")
    run_gpt(tmp_path, "fsdp", *common, "--strategy", "fsdp", "--devices", "2", "--micro-batch-size", "1",
            "--grad-accum", "2", "--count-comms")
    got = record(tmp_path, "fsdp")
    assert comm_rows(got["comm_counted"]) == comm_rows(got["comm_planned"])
    fields = {f.name for f in gpt.dataclasses.fields(gpt.Config)}
    cfg = gpt.resolve(gpt.Config(**{k: v for k, v in got["config"].items() if k in fields}))
    cfg = gpt.dataclasses.replace(cfg, precision="32-true")
    blocks = 2 * 2 * cfg.n_layer  # each block's gathers: 2 micro-batches x (forward, backward)
    float32 = {r["bytes"] for r in perf_model.comm_table(cfg) if r["kind"] == "all_gather" and r["count"] == blocks}
    bf16 = {r["bytes"] for r in got["comm_counted"] if r["kind"] == "all_gather" and r["count"] == blocks}
    assert len(float32) == 1 and bf16 == {float32.pop() // 2}
    assert losses(tmp_path, "fsdp") == pytest.approx(losses(tmp_path, "one"), rel=5e-3)
    assert losses(tmp_path, "fsdp") != pytest.approx(losses(tmp_path, "one"), rel=1e-6)  # not float32's gathers


def test_the_record_names_the_attention_kernel_that_ran(tmp_path):
    """PyTorch picks the SDPA kernel silently; the run records which one its shape got (here the CPU's flash kernel,
    and the unfused math one once dropout is on, which the CPU's flash kernel does not take), and the 1.6B preset's
    head dimension of 50 is named."""
    run_gpt(tmp_path, "plain", "--steps", "2")
    run_gpt(tmp_path, "dropout", "--steps", "2", "--dropout", "0.1")
    assert record(tmp_path, "plain")["attention_kernel"].startswith("SDPA flash (CPU), 4 heads x 16 dims x 64 positions")
    assert record(tmp_path, "dropout")["attention_kernel"].startswith("SDPA math")
    cfg = gpt.resolve(gpt.Config(model="1.6b", precision="bf16-mixed", seq_len=128))
    assert "32 heads x 50 dims x 128 positions in bfloat16" in gpt.attention_kernel(cfg, torch.device("cpu"), "sdpa")


def test_step_timer_hands_back_each_step_at_the_check_point():
    """Steps are timed without waiting for the device (CUDA events on a GPU, read at the next check point): each
    step's duration and whether it counts, in order, once."""
    import time

    from core.run.step_watch import StepTimer

    timer = StepTimer(torch.device("cpu"))
    for pause in (0.01, 0.02):
        timer.start()
        time.sleep(pause)
        timer.stop(timed=pause > 0.015)
    got = timer.collect()
    assert [timed for _, timed in got] == [False, True] and got[0][0] >= 0.01 and got[1][0] >= 0.02
    assert timer.collect() == []


def test_auto_attention_precision_follows_the_measurement(monkeypatch):
    """--attention-precision auto: float32 only for a 16-bit run on a CPU where the probe measured float32 SDPA
    faster at the run's shape; the 16-bit type on GPUs and where it is the faster; float32 runs are left alone.
    Without bf16 instructions float32, with nothing measured."""
    from core.gpt import gpt_model

    asked = []
    monkeypatch.setattr(gpt_model, "float32_attention_faster", lambda *a: asked.append(a) or faster)
    monkeypatch.setattr(gpt_model, "native_bf16", lambda: False)
    cfg = gpt.resolve(gpt.Config(model="tiny", precision="bf16-mixed", accelerator="cpu"))
    faster = False
    assert gpt.resolve_attention(cfg, on_gpu=False) == "float32" and not asked
    assert gpt.resolve_attention(cfg, on_gpu=True) == "autocast" and not asked
    monkeypatch.setattr(gpt_model, "native_bf16", lambda: True)
    cfg = gpt.resolve(gpt.Config(model="tiny", precision="bf16-mixed", accelerator="cpu"))
    faster = True
    assert gpt.resolve_attention(cfg, on_gpu=False) == "float32"
    assert asked[-1][:4] == (4, 64, 16, 4) and asked[-1][4] == torch.bfloat16  # heads, positions, head dim, micro-batch
    faster = False
    assert gpt.resolve_attention(cfg, on_gpu=False) == "autocast"
    assert gpt.resolve_attention(cfg, on_gpu=True) == "autocast"
    calls = len(asked)
    assert gpt.resolve_attention(gpt.dataclasses.replace(cfg, precision="32-true"), on_gpu=False) == "autocast"
    assert gpt.resolve_attention(gpt.dataclasses.replace(cfg, attention_precision="float32"), on_gpu=True) == "float32"
    assert len(asked) == calls  # nothing measured where nothing is to be decided


def test_the_attention_probe_of_a_long_sequence_is_measured_at_most_the_kernels_block_scale(tmp_path, monkeypatch):
    """--attention-precision auto on a 100,000-position run: the probe times SDPA at 2,048 positions (past 768 the CPU
    kernel's blocks are the same), in seconds, where the run's own length took minutes a call; shorter runs keep
    their own length. The cache entry says which shape was timed."""
    from core.gpt import gpt_model

    monkeypatch.setenv("FABRIC_LAB_CACHE", str(tmp_path))
    for positions, timed in ((100_000, gpt_model.ATTENTION_PROBE_POSITIONS), (64, 64)):
        gpt_model.float32_attention_faster(2, positions, 16, 1, torch.bfloat16, 1)
        entries = [json.loads(name) for name in json.loads((tmp_path / "cpu-probe.json").read_text())]
        assert entries[-1]["kind"] == "attention" and entries[-1]["seq_len"] == timed, entries[-1]
    assert gpt_model.ATTENTION_PROBE_POSITIONS == 2048 and len(entries) == 2


def test_auto_precision_is_bf16_on_gpus_and_float32_without_bf16_instructions(monkeypatch):
    """--precision auto (the default): bf16 autocast on GPUs and in plans for them, resolved with the flags; on a CPU
    without bf16 instructions float32, with nothing measured (torch would emulate bf16)."""
    from core.gpt import cpu_precision

    assert gpt.Config().precision == "auto"
    assert gpt.resolve(gpt.Config(model="tiny", accelerator="cuda")).precision == "bf16-mixed"
    assert gpt.resolve(gpt.Config(model="gpt2", plan=True, cluster="h100-sxm")).precision == "bf16-mixed"
    assert gpt.resolve(gpt.Config(model="tiny", accelerator="cpu")).precision == "auto"  # measured in validate()
    big = gpt.resolve(gpt.Config(model="gpt2", accelerator="cpu"))  # its step is its matmuls: their rates decide
    never = lambda: pytest.fail("a model this size is not probed step by step")  # noqa: E731
    monkeypatch.setattr(cpu_precision, "native_bf16", lambda: True)
    paths = accounting._measure_matmul_peak("bf16-mixed", 64, 0.01)[1].rsplit(": ", 1)[0]  # the probe's own words
    for bf16, fastest, expected in ((2e11, "bf16 matmul", "bf16-mixed"), (1.02e11, "bf16 addmm", "32-true"),
                                    (1e11, "float32 matmul", "32-true"),  # float32's own matmul, timed a second time
                                    (1.2e11, "float32 matmul", "32-true")):  # under less load (a Xeon, 2026-11-29)
        peaks = lambda: ((1e11, "float32 matmul"), (bf16, f"{paths}: {fastest}"))  # noqa: E731
        assert cpu_precision.choose(big, 1, never, peaks)["choice"] == expected, fastest
    # a long sequence's step is its attention: 1 x 20,000 positions of tiny is not timed step by step (minutes)
    long = gpt.resolve(gpt.Config(model="tiny", accelerator="cpu", seq_len=20000, micro_batch_size=1))
    assert cpu_precision.choose(long, 1, never, lambda: ((1e11, "float32 matmul"), (1e11, "float32 matmul")))
    tiny = gpt.resolve(gpt.Config(model="tiny", accelerator="cpu"))
    assert cpu_precision.probe_flops(tiny) < cpu_precision.STEP_BUDGET
    monkeypatch.undo()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the caps hide bf16 instructions (hardware.native_bf16)
    cfg = gpt.resolve(gpt.Config(model="tiny", accelerator="cpu"))
    gpt.resolve_precision(cfg)
    assert cfg.precision == "32-true" and "no bf16 instructions" in cpu_precision.note(gpt.precision_choice)


def test_auto_precision_on_a_cpu_is_the_measured_faster_and_trains_in_it(tmp_path, monkeypatch):
    """On a CPU with bf16 instructions --precision auto times this run's model (cut to 2 blocks) in float32 and bf16
    autocast once, caches the times, takes bf16 only clearly faster, and the run trains in the precision chosen:
    config.json records it and the start-up line gives both speeds. A cached answer decides the next run (here one
    written to say bf16: that run trains in bf16-mixed), and a resumed run keeps the precision it trained in."""
    from core.gpt import cpu_precision

    monkeypatch.setenv("FABRIC_LAB_CACHE", str(tmp_path / "cache"))
    args = [a for a in SMALL if a not in ("--precision", "32-true")] + ["--steps", "2"]
    first = run_gpt(tmp_path, "first", *args, base=[])
    ran = json.loads((tmp_path / "first" / "config.json").read_text())["precision"]
    cfg = gpt.parse_args(args)  # as validate() resolves it: --precision auto still open
    if not hardware.native_bf16():
        assert ran == "32-true" and "no bf16 instructions" in first.stdout
        return
    settings = cpu_precision.probe_settings(cfg, measurements.rank_threads(1))
    entry = measurements.cached("precision", settings, None, allow_measure=False)
    windows = entry["windows"]
    assert len(windows["32-true"]) == len(windows["bf16-mixed"]) == 8 and min(windows["32-true"]) > 0
    bf16 = measurements.clearly_faster(windows["bf16-mixed"], windows["32-true"])
    assert ran == entry["choice"] == ("bf16-mixed" if bf16 else "32-true")
    assert re.search(rf"precision auto: {ran} \(a 2-block step .*bf16 autocast [\d,]+ tokens/s, float32 [\d,]+",
                     first.stdout)
    written = {**entry, "choice": "bf16-mixed"}
    measurements.cache_file().write_text(json.dumps({measurements.entry_name("precision", settings): {"value": written}}))
    run_gpt(tmp_path, "second", *args, base=[])
    assert json.loads((tmp_path / "second" / "config.json").read_text())["precision"] == "bf16-mixed"
    # measured again, float32 might win: a resume keeps the run's own precision, and its GELU, here with the cache
    # saying the other is faster (a new measurement near the margin), and its attention's dtype
    measurements.cache_file().unlink()
    second = json.loads((tmp_path / "second" / "config.json").read_text())
    ran = gpt.Config(**{f.name: second[f.name] for f in dataclasses.fields(gpt.Config) if f.name in second})
    other = {"torch_s": 1.0, "cpp_s": 2.0} if second["gelu_impl"] == "cpp" else {"torch_s": 2.0, "cpp_s": 1.0}
    tokens, width = gpt.gelu_shape(ran)
    settings = {"tokens": tokens, "width": width, "dtype": str(gpt.math_dtype(ran)),
                "threads": measurements.rank_threads(ran.devices), "kernel": gpt.gelu_ext.KERNEL_VERSION}
    measurements.cache_file().write_text(json.dumps({measurements.entry_name("gelu_tanh", settings): {"value": other}}))
    assert gpt.gelu_speeds(ran, allow_measure=False) == other
    resumed = run_gpt(tmp_path, "second", *args, "--steps", "3", "--resume", "auto", base=[])
    assert "precision auto: bf16-mixed (the precision the resumed run trained in" in resumed.stdout
    kept = record(tmp_path, "second")["config"]
    assert (kept["precision"], kept["gelu_impl"], kept["attention_precision"]) == (
        "bf16-mixed", second["gelu_impl"], second["attention_precision"])


def test_auto_gelu_follows_the_measurement_and_cpp_is_refused_under_tensor_parallel(monkeypatch):
    """--gelu-impl auto: on a CPU the lab's C++ tanh GELU where it is built and measured faster at the run's MLP shape
    (micro-batch x positions, 4 x width), in the dtype the MLP computes in; F.gelu on GPUs, under --compile and under
    tensor parallelism, where nothing is measured. The C++ operator under tp is refused with the fix."""
    import gelu_ext

    asked = []
    monkeypatch.setattr(gelu_ext, "tanh_speeds", lambda *a, **k: asked.append(a) or {"cpp_s": cpp, "torch_s": 1.0})
    cfg = gpt.resolve(gpt.Config(model="tiny", precision="bf16-mixed", accelerator="cpu"))
    for cpp, impl in ((0.5, "cpp"), (2.0, "torch")):
        assert gpt.resolve_gelu(cfg, on_gpu=False) == impl
    assert asked[-1][:3] == (4 * 63, 4 * 64, torch.bfloat16)  # tokens (4 windows of 64: 63 positions), width, autocast's dtype
    calls, cpp = len(asked), 0.5
    for other, on_gpu in (({}, True), ({"compile": True}, False), ({"strategy": "tp", "devices": 2}, False)):
        assert gpt.resolve_gelu(gpt.resolve(gpt.dataclasses.replace(cfg, **other)), on_gpu) == "torch", other
    monkeypatch.setattr(gelu_ext, "is_built", lambda: False)  # never a half-minute build inside a run
    assert gpt.resolve_gelu(cfg, on_gpu=False) == "torch" and len(asked) == calls
    for impl in ("torch", "cpp"):  # a named one is taken as named
        assert gpt.resolve_gelu(gpt.dataclasses.replace(cfg, gelu_impl=impl), on_gpu=True) == impl
    with pytest.raises(gpt.ConfigError, match="--gelu-impl cpp with --strategy tp.*--gelu-impl torch"):
        gpt.validate(gpt.resolve(gpt.Config(model="tiny", strategy="tp", devices=2, gelu_impl="cpp", accelerator="cpu")))


def test_the_cpp_gelu_trains_as_f_gelu_and_changes_no_checkpoint_or_export(tmp_path):
    """The same run with the MLP's GELU from F.gelu and from the lab's C++ operator: the same losses to float32
    rounding, the same checkpoint keys, an hf/ folder that names transformers' own activation, and the start-up line
    says which computed it."""
    common = ["--steps", "6", "--log-every", "1", "--export"]
    torch_run = run_gpt(tmp_path, "torch", *common, "--gelu-impl", "torch")
    cpp_run = run_gpt(tmp_path, "cpp", *common, "--gelu-impl", "cpp")
    assert "GELU (tanh): the lab's C++ operator (gelu_ext)" in cpp_run.stdout
    assert "GELU (tanh): F.gelu (torch)" in torch_run.stdout
    assert losses(tmp_path, "cpp") == pytest.approx(losses(tmp_path, "torch"), rel=1e-5)
    assert record(tmp_path, "cpp")["config"]["gelu_impl"] == "cpp"
    state = lambda name: torch.load(next((tmp_path / name / "checkpoints").glob("step-*")) / "state",  # noqa: E731
                                    weights_only=False)["model"]
    assert sorted(state("cpp")) == sorted(state("torch"))
    exported = json.loads((tmp_path / "cpp" / "hf" / "config.json").read_text())
    assert exported["activation_function"] == "gelu_pytorch_tanh"


@pytest.mark.slow
def test_float32_attention_trains_as_bf16_attention_and_exports_plain_sdpa(tmp_path):
    """A bf16-mixed run with attention in float32 (what auto chooses on a CPU whose bf16 flash backward is slower):
    it records that kernel, trains as bf16 attention does to bf16 rounding, and its hf/ folder loads in transformers
    without this repository (attention "sdpa") with the same logits as the run's own model."""
    from transformers import AutoModelForCausalLM

    common = ["--precision", "bf16-mixed", "--steps", "6", "--log-every", "1"]
    run_gpt(tmp_path, "f32", *common, "--attention-precision", "float32", "--export")
    run_gpt(tmp_path, "bf16", *common, "--attention-precision", "autocast")
    f32, bf16 = record(tmp_path, "f32"), record(tmp_path, "bf16")
    assert "in float32" in f32["attention_kernel"] and "in bfloat16" in bf16["attention_kernel"]
    assert losses(tmp_path, "f32") == pytest.approx(losses(tmp_path, "bf16"), rel=2e-2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "f32" / "hf")
    assert loaded.config._attn_implementation == "sdpa"
    assert loaded.dtype == torch.bfloat16  # the run's training dtype: compared below in float32, on the same weights
    loaded = loaded.float()
    cfg = gpt.resolve(gpt.Config(model="tiny", attention_precision="float32", precision="bf16-mixed"))
    ours = gpt.build_model(cfg)
    assert ours.config._attn_implementation == gpt_model.SDPA_FLOAT32
    ours.load_state_dict(loaded.state_dict(), strict=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, loaded(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_the_chunked_loss_is_transformers_loss(precision):
    """--chunked-loss's head and cross-entropy, a chunk of tokens at a time with both gradients taken in one pass,
    against transformers' own (the head, then ForCausalLMLoss on the whole logits): equal in float32, within bf16's
    rounding under autocast and in bf16 (the gradients accumulated in float32 there, the reference in bf16)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from core.gpt.chunked_loss import causal_lm_loss

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    hidden = torch.randn(3, 17, 32, dtype=dtype, requires_grad=True)
    weight = (torch.randn(101, 32) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, 101, (3, 17))
    labels[0, 3] = -100  # ignored, as transformers ignores it
    grads = []
    for loss_of in (lambda: ForCausalLMLoss(hidden @ weight.t(), labels, 101), lambda: causal_lm_loss(hidden, weight, labels, chunk=7)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = loss_of()
        loss.backward()
        grads.append((loss.detach(), hidden.grad, weight.grad))
        hidden.grad = weight.grad = None
    tol = {"32-true": 1e-6, "bf16-mixed": 1e-2, "bf16-true": 1e-2}[precision]
    for ref, got in zip(*grads):
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        assert float(causal_lm_loss(hidden, weight, labels, chunk=5)) == pytest.approx(float(grads[1][0]), rel=1e-5)


def test_a_run_with_the_chunked_loss_trains_as_the_whole_head_does(single, tmp_path):
    """A run with --chunked-loss (no logits of every token) gives the single process's losses step by step; ZeRO-3,
    tp and pp, whose head is gathered per module or split, are refused with the fix."""
    run_gpt(tmp_path, "chunked", "--micro-batch-size", "4", "--chunked-loss", base=EXACT)
    assert losses(tmp_path, "chunked") == pytest.approx(losses(*single), rel=1e-5)
    with pytest.raises(gpt.ConfigError, match="--chunked-loss reads the head's weight"):
        gpt.validate(gpt.resolve(gpt.Config(strategy="deepspeed_stage_3", devices=2, chunked_loss=True)))


def test_a_padded_vocabulary_trains_as_the_unpadded_one_and_exports_without_its_padding(tmp_path):
    """--pad-vocab-to 64 (issue 69's tensor-core shapes): a vocabulary of 250 becomes 256 rows of the embedding and
    head, which the parameter count holds; the padding's logits are masked, so the losses equal the unpadded run's
    step by step, with the whole head and with the chunked loss; the padding rows stay zero, and the exported folder
    is the 250-token model, whose logits are the unpadded run's export's."""
    from transformers import GPT2LMHeadModel

    common = ["--vocab-size", "250", "--micro-batch-size", "4"]
    run_gpt(tmp_path, "plain", *common, base=EXACT)
    run_gpt(tmp_path, "padded", *common, "--pad-vocab-to", "64", base=EXACT)
    run_gpt(tmp_path, "chunked", *common, "--pad-vocab-to", "64", "--chunked-loss", base=EXACT)
    reference = losses(tmp_path, "plain")
    assert losses(tmp_path, "padded") == pytest.approx(reference, rel=1e-5)
    assert losses(tmp_path, "chunked") == pytest.approx(reference, rel=1e-5)
    last = sorted((tmp_path / "padded" / "checkpoints").glob("step-*"))[-1]
    embedding = torch.load(last / "state", weights_only=False)["model"]["transformer.wte.weight"]
    assert embedding.shape[0] == 256 and embedding[:250].abs().sum() > 0 and not embedding[250:].any()
    plain, padded = (GPT2LMHeadModel.from_pretrained(tmp_path / name / "hf") for name in ("plain", "padded"))
    assert padded.config.vocab_size == 250 and padded.transformer.wte.weight.shape[0] == 250
    tokens = torch.arange(16)[None]
    torch.testing.assert_close(padded(tokens).logits, plain(tokens).logits, rtol=1e-4, atol=1e-4)
    sized = lambda multiple: gpt.resolve(gpt.Config(model="tiny", vocab_size=250, pad_vocab_to=multiple))  # noqa: E731
    assert gpt.count_parameters(sized(64))[0] - gpt.count_parameters(sized(1))[0] == 6 * sized(1).n_embd


@pytest.mark.slow
def test_fsdp_with_the_chunked_loss_equals_one_process(single, tmp_path):
    run_gpt(tmp_path, "chunked", "--strategy", "fsdp", "--devices", "2", *TWO_PROCESS["fsdp"], "--chunked-loss",
            base=EXACT)
    assert losses(tmp_path, "chunked") == pytest.approx(losses(*single), rel=1e-4)


def test_the_summary_of_a_run_with_no_loss_logged_says_so(tmp_path, capsys):
    """A run resumed from a checkpoint taken before its first log point, with --steps at or below that step, trains
    nothing and has no loss to show (CI met it: a killed run's checkpoint at step 40, --log-every 50, --steps 30): its
    summary says so instead of ending in a TypeError, and the start line says that no step is left."""
    run_gpt(tmp_path, "r", "--steps", "2")
    rec = record(tmp_path, "r")
    assert rec["steps_here"] == 2
    rec.update(losses=[], first_loss=None, final_loss=None, steps=40, steps_here=0, timed_steps=0)
    gpt_figures.print_summary(gpt.Fabric(accelerator="cpu", devices=1), rec)
    out = capsys.readouterr().out
    assert "none logged (no log point among the steps trained)" in out and "no step trained in this process" in out
    fabric = gpt.Fabric(accelerator="cpu", devices=1)
    cfg = gpt.parse_args([*SMALL, "--steps", "2", "--out-dir", str(tmp_path)])
    run = type("R", (), {"fabric": fabric, "cfg": cfg, "state": {"progress": gpt.Progress(step=4, schedule_steps=12)}})()
    n_params, attn = gpt.count_parameters(run.cfg)
    gpt.announce(run, n_params, (1e12, "probe"), attn, gpt.disk_plan(run.cfg))
    assert "no step left: the run is at step 4 and this command ends it at 2" in capsys.readouterr().out


def test_a_timing_run_without_the_final_checkpoint_leaves_its_record_only(tmp_path):
    """--no-save-at-end (gpu-check's 1.6B rows: the step is timed, not the 19 GB save): the record and its figures,
    no checkpoint; --checkpoint-every still saves on the way."""
    run_gpt(tmp_path, "timed", "--steps", "4", "--no-save-at-end")
    assert record(tmp_path, "timed")["steps"] == 4 and not list((tmp_path / "timed" / "checkpoints").glob("step-*"))
    run_gpt(tmp_path, "every", "--steps", "4", "--no-save-at-end", "--checkpoint-every", "2", "--keep-last", "3")
    assert sorted(p.name for p in (tmp_path / "every" / "checkpoints").glob("step-*")) == ["step-00000002",
                                                                                        "step-00000004"]


def test_the_gpu_levers_are_the_default_on_gpus_only_and_where_proven():
    """make gpt on a GPU (or its plan): compiled blocks, the chunked loss, the vocabulary padded to 64; on a CPU none;
    under the strategies that refuse a lever or have not proven it none either; a flag always wins."""
    def levers(*flags):
        cfg = gpt.parse_args(["--model", "1.6b", "--precision", "bf16-mixed", *flags])
        return cfg.compile, cfg.chunked_loss, cfg.pad_vocab_to, cfg.compile_scope
    assert levers("--accelerator", "cpu") == (False, False, 1, "model")
    assert levers("--plan", "--cluster", "h200-sxm") == (True, True, 64, "blocks")
    assert levers("--plan", "--cluster", "h200-sxm", "--strategy", "ddp", "--devices", "8") == (True, True, 64, "blocks")
    for strategy in ("deepspeed_stage_3", "fsdp", "tp", "pp"):
        assert levers("--plan", "--cluster", "h200-sxm", "--strategy", strategy, "--devices", "2")[:3] == (False, False, 1)
    assert levers("--plan", "--cluster", "h200-sxm", "--no-compile", "--pad-vocab-to", "1") == (False, True, 1, "blocks")
    assert levers("--accelerator", "cpu", "--compile", "--chunked-loss")[:2] == (True, True)
