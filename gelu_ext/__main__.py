"""python -m gelu_ext check | bench: verify the hand-written GELUs against F.gelu, or time them.

Both print a table and write a JSON record to runs/gelu/ for `make report`.
"""

import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from core.run.files import write_json_atomic
from gelu_ext import APPROXIMATIONS, GeluBuildError, cuda_implementation, gelu_cpp, gelu_py, load_cpp


def environment() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": cpu,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_threads": torch.get_num_threads(),
            "cuda_implementation": cuda_implementation()}

IMPLEMENTATIONS = {"py": gelu_py, "cpp": gelu_cpp}
DTYPES = ("float32", "bfloat16", "float16")


def max_errors(fn, approximate: str, dtype: torch.dtype, device: str = "cpu", n: int = 1_000_000, seed: int = 0) -> dict:
    """Largest forward and input-gradient differences from F.gelu, and the two losses, on fresh inputs
    spanning small and large magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 1.5, n, dtype=torch.float64)
    x = x.to(device, dtype)
    upstream = torch.randn(n, generator=g, dtype=torch.float64).to(device, dtype)
    results = []
    for f in (fn, lambda t, a: F.gelu(t, approximate=a)):
        xi = x.clone().requires_grad_()
        y = f(xi, approximate)
        (y * upstream).sum().backward()
        results.append((y.detach(), xi.grad, float((y * upstream).sum().detach())))
    (y, gx, loss), (y_ref, gx_ref, loss_ref) = results
    return {"forward_max_abs_err": float((y - y_ref).abs().max()), "grad_max_abs_err": float((gx - gx_ref).abs().max()),
            "loss": loss, "loss_ref": loss_ref}


def gradcheck(fn, approximate: str, device: str = "cpu") -> bool:
    x = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).mul(3).to(device).requires_grad_()
    return torch.autograd.gradcheck(lambda t: fn(t, approximate), (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


def check(args) -> int:
    load_cpp()
    rows = []
    print(f"{'impl':<5}{'approx':<7}{'dtype':<9}{'max |dy|':>11}{'max |dx|':>11}{'loss':>16}{'F.gelu loss':>16}  gradcheck")
    for name, fn in IMPLEMENTATIONS.items():
        for approximate in APPROXIMATIONS:
            ok = gradcheck(fn, approximate, args.device)
            for dtype in (torch.float32, torch.float64, *(getattr(torch, d) for d in args.dtypes if d != "float32")):
                r = {"impl": name, "approximate": approximate, "dtype": str(dtype).removeprefix("torch."),
                     **max_errors(fn, approximate, dtype, args.device), "gradcheck_float64": ok, "device": args.device}
                rows.append(r)
                print(f"{name:<5}{approximate:<7}{r['dtype']:<9}{r['forward_max_abs_err']:>11.2e}"
                      f"{r['grad_max_abs_err']:>11.2e}{r['loss']:>16.6f}{r['loss_ref']:>16.6f}  {'passed' if ok else 'FAILED'}")
    write_json_atomic(f"{args.out}/check.json", {"rows": rows, "env": environment()})
    print(f"wrote {args.out}/check.json")
    return 0 if all(r["gradcheck_float64"] for r in rows) else 1


def time_interleaved(fns: dict, x: torch.Tensor, repeats: int, warmup: int = 3) -> dict:
    """Median seconds of one forward+backward per implementation. The implementations take turns within
    each repetition, so a noisy neighbour on the machine slows all of them alike; the upstream gradient is
    allocated once, outside the clock."""
    grad = torch.ones_like(x)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)  # CUDA kernels run asynchronously
    times = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            xi = x.detach().requires_grad_()
            sync()
            start = time.perf_counter()
            fn(xi).backward(grad)
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def queued_ms(fn, device: str, calls: int = 50) -> float:
    """Milliseconds a call of `fn` when `calls` of them are queued back to back: on a GPU, CUDA events around the
    loop time the kernels, not the host's per-call work (which overlaps them)."""
    for _ in range(3):
        fn()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return 1e3 * (time.perf_counter() - start) / calls
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / calls


def op_ratios(x: torch.Tensor, approximate: str) -> dict:
    """The C++ operator's forward and backward alone (no autograd) against ATen's GELU ops, queued."""
    grad = torch.ones_like(x)
    ops, device = torch.ops.gelu_ext, x.device.type
    forward = queued_ms(lambda: ops.gelu_forward(x, approximate), device) / queued_ms(
        lambda: torch.ops.aten.gelu(x, approximate=approximate), device)
    backward = queued_ms(lambda: ops.gelu_backward(grad, x, approximate), device) / queued_ms(
        lambda: torch.ops.aten.gelu_backward(grad, x, approximate=approximate), device)
    return {"forward_op_ratio": forward, "backward_op_ratio": backward}


def bench(args) -> int:
    load_cpp()
    rows = []
    print(f"forward+backward of {args.numel:,} elements on {args.device}, median of {args.repeats} interleaved repetitions "
          f"after warm-up, {torch.get_num_threads()} threads")
    print(f"{'dtype':<10}{'approx':<7}{'impl':<13}{'ms':>9}{'vs F.gelu':>11}   the C++ ops alone, queued, vs ATen's")
    for dtype in args.dtypes:
        x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(args.device, getattr(torch, dtype))
        for approximate in APPROXIMATIONS:
            impls = {"F.gelu": lambda t: F.gelu(t, approximate=approximate),
                     "gelu_py": lambda t: gelu_py(t, approximate), "gelu_cpp": lambda t: gelu_cpp(t, approximate)}
            seconds = time_interleaved(impls, x, args.repeats)
            ops = op_ratios(x, approximate)
            for name, sec in seconds.items():
                ratio = sec / seconds["F.gelu"]
                rows.append({"dtype": dtype, "approximate": approximate, "impl": name, "ms": 1e3 * sec, "ratio": ratio,
                             **(ops if name == "gelu_cpp" else {})})
                alone = (f"   forward {ops['forward_op_ratio']:.2f}x, backward {ops['backward_op_ratio']:.2f}x"
                         if name == "gelu_cpp" else "")
                print(f"{dtype:<10}{approximate:<7}{name:<13}{1e3 * sec:>9.2f}{ratio:>10.2f}x{alone}")
    write_json_atomic(f"{args.out}/bench.json", {"numel": args.numel, "repeats": args.repeats, "rows": rows, "device": args.device,
                                                 "env": environment()})
    print(f"wrote {args.out}/bench.json")
    return 0


def build_parser():
    from core.run.flags import Folder, Parser, choice, number

    parser = Parser(description=__doc__, prog="python -m gelu_ext")
    parser.add_argument("command", type=choice(("check", "bench")), help="check: errors and gradcheck; bench: speed")
    parser.add_argument("--numel", type=number(int, min=1, max=2**28), default=16 * 1024 * 1024,
                        help="bench: elements of the test tensor (default: 16M; at most 2^28, 1 GiB of float32)")
    parser.add_argument("--repeats", type=number(int, min=1, max=10**6), default=21, help="bench: timed repetitions "
                        "(default: 21)")
    parser.add_argument("--out", default="runs/gelu", type=Folder(), help="folder for the JSON record (default: runs/gelu)")
    parser.add_argument("--device", default="cpu", type=choice(("cpu", "cuda")), help="where the tensors live "
                        "(default: cpu; cuda: the C++ op's CUDA kernel, or its ATen fallback when built without nvcc)")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], type=choice(DTYPES), metavar="DTYPE",
                        help=f"bench: the dtypes timed; check: the reduced ones added to float32/float64 "
                        f"({', '.join(DTYPES)}; default: float32)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"error: --device {args.device}: no CUDA GPU is visible here; use --device cpu")
    try:
        sys.exit(check(args) if args.command == "check" else bench(args))
    except GeluBuildError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
