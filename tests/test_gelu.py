"""gelu_ext: both hand-written GELUs against F.gelu and gradcheck, the real C++ build, and a LeNet run."""

import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gelu_ext
from gelu_ext import GELU, gelu_cpp, gelu_py

IMPLS = {"py": gelu_py, "cpp": gelu_cpp}
# Tolerances: float32/reduced precisions differ from F.gelu only in the last bits of erf/tanh; bfloat16/float16
# results are rounded to 8/11-bit mantissas. float64 agrees to ~1e-16 in almost every run, but torch.erf (MKL)
# and F.gelu's own erf (Sleef) are different code: once, in a fresh-clone CI run, 175 of 4099 float64 outputs
# differed by up to 2.8e-11 (not reproduced in 6,000 local trials). 1e-9 still fails any wrong constant or formula.
TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def built():
    gelu_ext.load_cpp()  # the real JIT build with torch.utils.cpp_extension, cached in gelu_ext/build/


def fresh_inputs(dtype, n=4099, scale=8.0, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", list(TOL))
def test_forward_and_gradient_match_f_gelu(impl, approximate, dtype):
    x = fresh_inputs(dtype)
    upstream = fresh_inputs(dtype, scale=1.0)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = IMPLS[impl](a, approximate), F.gelu(b, approximate=approximate)
    (y * upstream).sum().backward()
    (y_ref * upstream).sum().backward()
    assert y.dtype == dtype and a.grad.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(a.grad, b.grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradcheck_float64(impl, approximate):
    x = fresh_inputs(torch.float64, n=50, scale=3.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: IMPLS[impl](t, approximate), (x,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_magnitudes(impl):
    x = torch.tensor([-1e4, -40.0, -10.0, 10.0, 40.0, 1e4], dtype=torch.float64)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(IMPLS[impl](x, approximate), F.gelu(x, approximate=approximate))


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_infinities_propagate_like_f_gelu(impl):
    # float64: F.gelu's own float32 SIMD path returns NaN for +inf in long tensors but +inf in short ones;
    # in float64 it is consistent (NaN -> NaN, +inf -> +inf, -inf -> NaN since -inf * 0 is NaN).
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0], dtype=torch.float64)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(IMPLS[impl](x, approximate), F.gelu(x, approximate=approximate), equal_nan=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_shapes_noncontiguous_and_empty(impl):
    x = fresh_inputs(torch.float32, n=6 * 5 * 4, seed=3).reshape(6, 5, 4)
    views = (x, x.transpose(0, 2), x[:, ::2, 1:], x.reshape(-1)[::3])
    assert [v.is_contiguous() for v in views] == [True, False, False, False]  # the strided paths are the ones tested
    for view in views:
        torch.testing.assert_close(IMPLS[impl](view, "none"), F.gelu(view))
    empty = torch.empty(0, 3)
    assert IMPLS[impl](empty, "none").shape == (0, 3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_and_bool_inputs_are_refused(impl, dtype):
    with pytest.raises(TypeError, match="floating-point"):
        IMPLS[impl](torch.ones(3, dtype=dtype), "none")


def test_cpp_op_is_registered_with_fake_kernel_and_compiles():
    torch.library.opcheck(torch.ops.gelu_ext.gelu_forward.default, (torch.randn(8, dtype=torch.float64), "none"))
    meta = torch.ops.gelu_ext.gelu_forward(torch.empty(4, 5, device="meta"), "tanh")
    assert meta.shape == (4, 5) and meta.device.type == "meta"
    compiled = torch.compile(lambda t: gelu_cpp(t, "none") * 2, backend="eager", fullgraph=True)
    x = torch.randn(10)
    torch.testing.assert_close(compiled(x), F.gelu(x) * 2)


def test_the_cpp_backward_is_a_cpp_node_and_runs_no_python():
    """Autograd is registered in C++ (GeluFunction at the Autograd key): the backward node is a C++ one and calling
    it runs no Python function (a Python backward makes autograd's CUDA device thread take the GIL)."""
    x = torch.randn(4096, requires_grad=True)
    y = gelu_cpp(x, "tanh")
    assert y.grad_fn.name() == "torch::autograd::CppNode<gelu_ext::GeluFunction>", y.grad_fn.name()
    called = []
    sys.setprofile(lambda frame, event, arg: called.append(frame.f_code.co_name) if event == "call" else None)
    try:
        out = y.grad_fn(torch.ones_like(y))
    finally:
        sys.setprofile(None)
    assert called == [], called
    grad = out[0] if isinstance(out, tuple) else out
    reference = x.detach().requires_grad_()
    F.gelu(reference, approximate="tanh").sum().backward()
    torch.testing.assert_close(grad, reference.grad)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", list(TOL))
def test_the_cuda_kernels_formula_matches_f_gelu_on_cpu(approximate, dtype):
    """gelu_math.h, the CUDA kernel's body, run one value at a time on CPU tensors (gelu_*_scalar): forward and
    input gradient against F.gelu and its autograd, reduced precisions computed in float as the kernel does."""
    x, g = fresh_inputs(dtype), fresh_inputs(dtype, scale=1.0)
    tol = 1e-12 if dtype == torch.float64 else TOL[dtype]
    torch.testing.assert_close(torch.ops.gelu_ext.gelu_forward_scalar(x, approximate), F.gelu(x, approximate=approximate),
                               atol=tol, rtol=tol)
    xr = x.clone().requires_grad_()
    F.gelu(xr, approximate=approximate).backward(g)
    torch.testing.assert_close(torch.ops.gelu_ext.gelu_backward_scalar(g, x, approximate), xr.grad, atol=tol, rtol=tol)


CUDA_BUILD_CHECK = """
import torch, gelu_ext
print(gelu_ext.cuda_implementation())
for op in ("gelu_forward", "gelu_backward"):
    print([line for line in torch._C._dispatch_dump(f"gelu_ext::{op}").splitlines() if line.startswith("CUDA:")])
libraries = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/gelu_ext_" in line})
print([(library.rsplit("/", 1)[-1], b".nv_fatbin" in open(library, "rb").read()) for library in libraries])
"""


@pytest.mark.slow  # nvcc in a process of its own: 91 s the first time on the AVX2 EPYC, too long for make test-fast
@pytest.mark.builds  # the GELU's CUDA kernel, which make setup builds only where a GPU is
def test_the_cuda_kernel_is_compiled_and_registered_where_nvcc_is(monkeypatch):
    """Build-only (no GPU here): with the CUDA toolkit, the extension holds device code for the course's GPUs and the
    CUDA dispatch key runs gelu_cuda.cu's kernels, not the ATen-op fallback. Without a GPU, `make setup` builds the
    CPU library only; GELU_EXT_CUDA=1 asks for the kernels' library too (a fresh process, since the ops are
    registered once a process), which loads beside the CPU library as built, not compiled again with it."""
    gelu_ext.load_cpp()  # the CPU library, as make setup built it
    name = gelu_ext.build_plan()[0][0]
    cpu_library = gelu_ext.BUILD_ROOT / name / f"{name}.so"
    built = cpu_library.stat().st_mtime_ns
    monkeypatch.setenv("GELU_EXT_CUDA", "1")
    if gelu_ext.cuda_toolkit() is None:
        pytest.skip("no CUDA toolkit (nvcc) or a CPU-only torch: the CPU build is the whole extension here")
    out = subprocess.run([sys.executable, "-c", CUDA_BUILD_CHECK], cwd=gelu_ext.SOURCE.parent.parent,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    implementation, forward, backward, libraries = out.stdout.strip().splitlines()[-4:]
    assert implementation == "gelu_cuda.cu kernel" and "Overriding" not in out.stderr  # the composite: a fallback
    for cuda in (ast.literal_eval(forward), ast.literal_eval(backward)):
        assert len(cuda) == 1 and "gelu_cuda.cu" in cuda[0], cuda
    # the CPU library as make setup built it, without device code, and the kernels' library beside it
    assert ast.literal_eval(libraries) == [(cpu_library.name, False), ("gelu_ext_cuda.so", True)]
    assert cpu_library.stat().st_mtime_ns == built  # not compiled again for the kernels' sake
    # device code for every kernel in every dtype the ops dispatch on, for each architecture: the device passes see
    # no launch, only gelu_cuda.cu's explicit instantiations, and a dtype left out of them builds and loads without a
    # word, its kernels neither registered nor in the fatbin (float16 left out: 12 kernels, each image 12)
    registered, images = device_kernels(gelu_ext.BUILD_ROOT / gelu_ext.CUDA_NAME / f"{gelu_ext.CUDA_NAME}.so")
    assert len(registered) == 16  # forward and backward, one by one and 16 bytes at a time, in 4 dtypes
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):  # the architectures it names
        assert len(images) == len(gelu_ext.CUDA_ARCHS_WITHOUT_GPU.split(";"))
    assert images and all(registered <= kernels for kernels in images), (registered, images)


def device_kernels(library: Path) -> tuple[set, list[set]]:
    """(the kernels a CUDA extension's host code registers, by the names it registers them with; the kernels each
    device-code image of its fatbin holds, one image an architecture), from the two sections binutils' objcopy dumps."""
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(["objcopy", "--dump-section", f".rodata={folder}/rodata", "--dump-section",
                        f".nv_fatbin={folder}/fatbin", library, os.devnull], check=True)
        rodata, fatbin = (Path(folder, name).read_bytes() for name in ("rodata", "fatbin"))
    registered = set(re.findall(rb"_ZN8gelu_ext\w*kernel\w*", rodata))
    images = fatbin.split(b"\x7fELF")[1:]
    return registered, [set(re.findall(rb"\.nv\.info\.(_ZN8gelu_ext\w+)", image)) for image in images]


@pytest.mark.slow
def test_loading_the_cpu_build_says_nothing_of_cuda():
    """Where nvcc is on PATH but no GPU is, torch's extension builder warns at import that it found no CUDA runtime and
    will use the toolkit: the CPU variant (make setup's, built without CUDA) loads without that line."""
    out = subprocess.run([sys.executable, "-c", "import gelu_ext; gelu_ext.load_cpp()"],
                         cwd=gelu_ext.SOURCE.parent.parent, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "No CUDA runtime" not in out.stderr, out.stderr[-3000:]


def test_a_machine_without_a_gpu_builds_the_cpu_variant_only(monkeypatch):
    """What `make setup` builds on a machine with nvcc but no GPU: the kernel could not run there."""
    monkeypatch.delenv("GELU_EXT_CUDA", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gelu_ext.cuda_toolkit() is None and len(gelu_ext.build_plan()) == 1
    monkeypatch.setenv("GELU_EXT_CUDA", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gelu_ext.cuda_toolkit() is None


def test_missing_compiler_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(gelu_ext, "_loaded", False)
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(gelu_ext.GeluBuildError, match="C\\+\\+ compiler.*no-such-compiler-xyz.*gelu_py"):
        gelu_ext.load_cpp()


def test_stale_build_lock_does_not_block(tmp_path):
    """A build killed mid-way leaves `lock` behind (older torch releases wait on it forever); the next load must not hang."""
    lock = gelu_ext.BUILD_ROOT / gelu_ext.build_plan()[0][0] / "lock"
    lock.write_text("")
    code = "import gelu_ext, torch; x = torch.randn(5); print(float((gelu_ext.gelu_cpp(x) - torch.nn.functional.gelu(x)).abs().max()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=gelu_ext.SOURCE.parent.parent, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-6


def test_module_choices():
    x = torch.randn(32)
    for impl in ("torch", "py", "cpp"):
        torch.testing.assert_close(GELU(impl, "tanh")(x), F.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="impl"):
        GELU("cuda")


def test_channels_last_keeps_its_layout_without_copies():
    x = torch.randn(4, 6, 5, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    y = gelu_cpp(x, "none")
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, F.gelu(x))
    y.backward(torch.ones_like(y))
    ref = x.detach().clone().requires_grad_()
    F.gelu(ref).backward(torch.ones_like(ref))
    torch.testing.assert_close(x.grad, ref.grad)
    torch.library.opcheck(torch.ops.gelu_ext.gelu_forward.default, (x.detach().double(), "tanh"))
    torch.library.opcheck(torch.ops.gelu_ext.gelu_backward.default, (torch.randn(3, 4).t(), torch.randn(3, 4).t(), "none"))


def test_an_extension_needed_by_two_processes_at_once_is_built_and_counted_once(tmp_path, monkeypatch):
    """make test's build line (extension_compiler.noted_build): two loaders of one op at once, as two tests of a
    fresh checkout: the second waits for the first and finds it built; one build is logged, not two."""
    import threading
    import time

    from core.host import extension_compiler

    log, output = tmp_path / "builds.jsonl", tmp_path / "op" / "op.so"
    monkeypatch.setenv(extension_compiler.BUILD_LOG, str(log))
    made = []

    def load():  # what torch's load does: build when the library is missing, else load it
        with extension_compiler.noted_build("op", output):
            if not output.exists():
                time.sleep(0.3)
                output.write_bytes(b"built")
                made.append(1)
    loaders = [threading.Thread(target=load) for _ in range(2)]
    for t in loaders:
        t.start()
    for t in loaders:
        t.join()
    lines = log.read_text().splitlines()
    assert len(made) == 1 and len(lines) == 1 and '"build": "op"' in lines[0]


def test_the_tanh_form_at_its_extremes_is_f_gelus():
    """The float32 tanh form is computed from exp(-2u) (gelu.cpp: Sleef's tanh was 3.5x slower), which overflows for
    x below about -10: the outputs there, at +-inf and NaN, and where the gradient is NaN (F.gelu's own x^3 overflow
    beyond 1e13) are F.gelu's."""
    x = torch.tensor([-1e30, -1e13, -1e4, -100.0, -44.5, -10.0, -0.0, 0.0, 1e-30, 10.0, 1e4, 1e30,
                      float("inf"), -float("inf"), float("nan")], requires_grad=True)
    ours, ref = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    y, y_ref = gelu_cpp(ours, "tanh"), F.gelu(ref, approximate="tanh")
    torch.testing.assert_close(y, y_ref, equal_nan=True, atol=1e-6, rtol=1e-6)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, equal_nan=True, atol=1e-6, rtol=1e-6)
