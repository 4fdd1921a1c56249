"""What a GPU run captures as a CUDA graph, run here on fake CUDA tensors: a capture fails at any read of a device
value to the host (`.item()`, a tensor turned into a Python number, a data-dependent shape), and so does a fake tensor
(torch's FakeTensorMode raises DataDependentOutputException at the read, whatever the device: no GPU needed). Each
program runs as the GPU would run it, on "cuda" tensors: the device-dependent branches (capturable and foreach
optimizers, device generators, channels-last convolutions) are the GPU's. The C++ autograd engine wants a real device
for its CUDA streams, so backward is walked node by node in Python here (`backward_in_python`, checked against the
engine on CPU). A failure names the line that read the host.

Captured on a GPU today: LeNet-5's whole step (`--cuda-graph`, core/lenet/whole_step.py) and the compiled LeNet-5
model's forward and backward (`--compile --compile-mode reduce-overhead`); its eager step is held to no host read as
well, which `--sync-check` asks of it on a GPU. No GPT step is captured (`--compile` there is torch.compile's default
mode); its step is checked for host reads all the same, each being a wait for the GPU."""

import traceback
import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

import datasets_local
import fabric_lenet
from core.lenet import graph_adamw, whole_step

HOST_READ = (DataDependentOutputException, torch._subclasses.fake_tensor.DynamicOutputShapeException)
TORCH_INTERNALS = ("torch/_subclasses/", "torch/utils/", "torch/_ops.py", "torch/_compile.py", "torch/_dynamo/",
                   "torch/_tensor.py", "torch/overrides.py")


# ----------------------------------------------------------------------------- fake CUDA
def reading_line(error: BaseException) -> str:
    """The line that read the host: the innermost frame of the traceback outside torch's dispatch machinery."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not any(part in f.filename for part in TORCH_INTERNALS)]
    f = frames[-1]
    return f"{f.filename.split('site-packages/')[-1]}:{f.lineno}: {f.line}"


def run_on_fake_cuda(program, *args):
    """program(*args) under the fake mode of its tensors; a host read fails the test with the line that read."""
    try:
        return program(*args)
    except HOST_READ as e:
        pytest.fail(f"a device value is read to the host ({type(e).__name__}: {e}) at {reading_line(e)}", pytrace=False)


def to_fake_cuda(mode: FakeTensorMode, module: torch.nn.Module) -> torch.nn.Module:
    """A real module's parameters and buffers as fake CUDA tensors, in place (their layout, dtype and values' shapes
    kept). Module.to() swaps tensors, which a fake tensor refuses, so each is set anew."""
    real = {id(t): t.detach() for t in [*module.parameters(), *module.buffers()]}
    fake = {key: mode.from_tensor(t) for key, t in real.items()}
    with mode:
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[name] = torch.nn.Parameter(fake[id(p)].to("cuda"), p.requires_grad)
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = fake[id(b)].to("cuda")
    return module


def backward_in_python(loss: torch.Tensor) -> None:
    """loss.backward() without the C++ engine: each node of the graph called once in reverse topological order, its
    gradients summed into the next nodes' inputs (reduced to their shape and dtype, as the engine does) and into the
    leaves' .grad."""
    order, seen, stack = [], set(), [(loss.grad_fn, False)]
    while stack:  # post-order, without recursion: a deep graph would exceed Python's stack
        node, done = stack.pop()
        if done:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack += [(n, False) for n, _ in node.next_functions if n is not None and n not in seen]
    pending = {loss.grad_fn: [torch.ones_like(loss)]}
    for node in reversed(order):
        grads = pending.pop(node, None)
        if grads is None:
            continue
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf
            leaf = node.variable
            leaf.grad = grads[0] if leaf.grad is None else leaf.grad + grads[0]
            continue
        out = (node.apply if isinstance(node, torch.autograd.function.BackwardCFunction) else node)(*grads)
        for (target, slot), grad in zip(node.next_functions, out if isinstance(out, tuple) else (out,)):
            if target is None or grad is None:
                continue
            meta = target._input_metadata[slot] if not hasattr(target, "variable") else target.variable
            grad = grad.sum_to_size(meta.shape).to(meta.dtype)
            inputs = pending.setdefault(target, [None] * max(len(getattr(target, "_input_metadata", [])), 1))
            inputs[slot] = grad if inputs[slot] is None else inputs[slot] + grad


def test_backward_in_python_is_the_engines_backward():
    """On CPU, against loss.backward(): a shared input, a broadcast bias, a reduction, a Python autograd Function."""
    from gelu_ext import GELU

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), GELU(impl="py"), torch.nn.Linear(7, 3))
    x, y = torch.randn(4, 5), torch.tensor([0, 2, 1, 2])

    def loss():
        h = model(x)
        return F.cross_entropy(h + h.square().mean(0), y)
    backward_in_python(loss())
    mine = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss().backward()
    for got, want in zip(mine, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want)


def test_a_host_read_on_fake_cuda_fails_with_the_line_that_read():
    """The harness itself: a program that reads a device value is stopped at that read, and the line is named."""
    def program(x):
        return x * x.sum().item()  # the read

    with FakeTensorMode():
        x = torch.ones(3, device="cuda")
        with pytest.raises(pytest.fail.Exception, match=r"test_capture.py:\d+: return x \* x.sum\(\).item\(\)"):
            run_on_fake_cuda(program, x)


def test_torchs_capturable_adamw_reads_a_tensor_beta1_to_the_host():
    """Why graph_adamw exists: torch's AdamW, capturable and foreach on CUDA, given OneCycleLR's beta1 as a device
    tensor, reads it to the host (torch/optim/adam.py's _foreach_lerp_ and _foreach_pow take numbers). When this
    stops failing, torch's AdamW can be the captured optimizer again."""
    with FakeTensorMode():
        w = torch.nn.Parameter(torch.randn(4, 3, device="cuda"))
        w.grad = torch.randn(4, 3, device="cuda")
        lr, beta1 = torch.tensor(1e-3, device="cuda"), torch.tensor(0.9, device="cuda")
        adamw = torch.optim.AdamW([w], lr=1e-3, capturable=True, foreach=True)
        adamw.param_groups[0].update(lr=lr, betas=(beta1, 0.999))
        with pytest.raises(HOST_READ) as read:
            adamw.step()
    assert "torch/optim/adam.py" in reading_line(read.value)


# ----------------------------------------------------------------------------- LeNet-5
def fake_lenet(mode: FakeTensorMode, dtype=torch.float32, **flags):
    """LeNet-5 as fabric_lenet builds it (channels-last, conv1's channels padded), on fake CUDA, with its AdamW and
    OneCycleLR, a stand-in for Fabric on one device (Fabric's CUDA accelerator needs a GPU), and fake MNIST tensors.
    Its inputs are cast to the weights' dtype on the way in, as Fabric's module wrapper does under `bf16-true`."""
    cfg = fabric_lenet.Config(accelerator="cuda", **flags)
    model, _ = fabric_lenet.make_model(cfg)
    model = to_fake_cuda(mode, model.to(dtype))
    model.register_forward_pre_hook(lambda _, args: tuple(a.to(dtype) for a in args))
    optimizer, scheduler = fabric_lenet.make_optimizer(cfg, model, total_steps=100)
    fabric = types.SimpleNamespace(device=torch.device("cuda"), backward=backward_in_python, world_size=1,
                                   global_rank=0)
    with mode:
        data = (torch.randn(1100, 1, 28, 28, device="cuda", dtype=dtype), torch.randint(0, 10, (1100,), device="cuda"))
    return cfg, fabric, model, optimizer, scheduler, data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["32-true", "bf16-true"])
def test_lenets_whole_step_reads_nothing_from_the_device(dtype):
    """The program `--cuda-graph` captures (core/lenet/whole_step.py: gather, shifts, forward, loss, backward, AdamW
    with OneCycleLR's learning rate and beta1 from device scalars), three steps on fake CUDA in float32 and bfloat16
    weights: no host read, so a capture can hold it. Fails on the AdamW of torch that the step first used (above).
    bf16-mixed's autocast cannot be entered for CUDA without a GPU; it changes the dtypes of the same ops."""
    mode = FakeTensorMode()
    cfg, fabric, model, optimizer, scheduler, (_, y) = fake_lenet(mode, dtype)
    with mode:
        split = types.SimpleNamespace(images=torch.randint(0, 256, (1100, 28, 28), dtype=torch.uint8, device="cuda"),
                                      labels=y)  # MNIST's pixels, as the in-memory path keeps them
        windows = fabric_lenet.memory_windows(split, fabric.device)
        step = whole_step.WholeStep(fabric, cfg, model, optimizer, scheduler, windows, 512, 3, None, datasets_local.normalize)
        step.indices.copy_(torch.randint(0, 1100, step.indices.shape, device="cuda"))  # what epoch() loads
        step.offsets.copy_(torch.randint(0, 5, step.offsets.shape, device="cuda"))
        for _ in range(3):
            step.lr.fill_(optimizer.param_groups[0]["lr"])
            step.beta1.fill_(optimizer.param_groups[0]["betas"][0])
            loss = run_on_fake_cuda(step.program)
    assert loss.device.type == "cuda" and loss.shape == ()
    assert all(optimizer.state[p]["step"].device.type == "cuda" for p in model.parameters())


def test_lenets_eager_step_reads_nothing_from_the_device():
    """fabric_lenet.train_step on fake CUDA: the model's forward and backward (what `--compile --compile-mode
    reduce-overhead` captures), the loss and fused AdamW. `--sync-check` fails a GPU step at any host wait. The batch's
    shifts are drawn by a CUDA generator there, which a machine without CUDA cannot make: drawn ahead here."""
    mode = FakeTensorMode()
    cfg, fabric, model, optimizer, scheduler, (x, y) = fake_lenet(mode, augment=False)
    with mode:
        for step in range(3):
            xb, yb = x[512 * step:512 * (step + 1)], y[512 * step:512 * (step + 1)]
            xb = datasets_local.shift(xb, *torch.randint(0, 5, (2, len(xb)), device="cuda"))  # as random_shift does
            loss = run_on_fake_cuda(fabric_lenet.train_step, fabric, model, optimizer, scheduler, xb, yb, cfg)
    assert loss.device.type == "cuda"


def test_graph_adamw_is_torchs_adamw_with_beta1_cycled():
    """graph_adamw against torch.optim.AdamW (fused, numbers for hyperparameters) under OneCycleLR, which cycles beta1
    between 0.85 and 0.95: 30 steps of the same gradients, the weights equal to float32 rounding, the states too."""
    torch.manual_seed(0)
    shapes = [(6, 1, 5, 5), (6,), (84, 120)]
    torch_params = [torch.randn(s, requires_grad=True) for s in shapes]
    graph_params = [p.detach().clone().requires_grad_() for p in torch_params]
    reference = torch.optim.AdamW(torch_params, lr=8e-3, weight_decay=5e-4, fused=True)
    mine = torch.optim.AdamW(graph_params, lr=8e-3, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=8e-3, total_steps=30)
    lr, beta1, betas = torch.zeros(()), torch.zeros(()), set()
    for _ in range(30):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(torch_params, graph_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        lr.fill_(reference.param_groups[0]["lr"])
        beta1.fill_(reference.param_groups[0]["betas"][0])
        betas.add(round(reference.param_groups[0]["betas"][0], 3))
        reference.step()
        graph_adamw.init_state(mine)
        graph_adamw.step(mine, lr, beta1)
        schedule.step()
    assert len(betas) > 10  # beta1 did cycle
    for p, q in zip(torch_params, graph_params):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(mine.state[q][key], reference.state[p][key], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- GPT-2
@pytest.mark.parametrize("levers", [[], ["--chunked-loss", "--pad-vocab-to", "64"]], ids=["plain", "gpu-levers"])
def test_gpts_step_reads_nothing_from_the_device(levers):
    """fabric_gpt.step_data_parallel on fake CUDA (the tiny preset, two micro-batches, clipping, fused AdamW, transformers'
    SDPA without a mask), plain and with the GPU levers (the chunked loss, the padded vocabulary):
    each host read would be a wait for the GPU in every step. Fabric's set-up needs a GPU: a stand-in gives the
    step what one device's Fabric gives it."""
    import contextlib

    import fabric_gpt
    from core.gpt import gpt_model

    cfg = fabric_gpt.parse_args(["--model", "tiny", "--accelerator", "cuda", "--micro-batch-size", "2", *levers])
    mode = FakeTensorMode()
    model = to_fake_cuda(mode, gpt_model.build_model(cfg))
    optimizer = fabric_gpt.make_optimizer(cfg, model)
    fabric = types.SimpleNamespace(
        device=torch.device("cuda"), backward=backward_in_python, strategy=types.SimpleNamespace(precision=None),
        no_backward_sync=lambda module, enabled: contextlib.nullcontext(),
        clip_gradients=lambda module, opt, max_norm, error_if_nonfinite: torch.nn.utils.clip_grad_norm_(
            module.parameters(), max_norm, error_if_nonfinite=error_if_nonfinite))  # Fabric's, on one device
    run = types.SimpleNamespace(fabric=fabric, cfg=cfg)
    with mode:
        tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_len), device="cuda")
        for _ in range(2):
            loss, norm, skipped = run_on_fake_cuda(fabric_gpt.step_data_parallel, run, model, optimizer, [tokens, tokens])
    assert loss.device.type == norm.device.type == "cuda" and not skipped
