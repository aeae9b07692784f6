"""Every Triton kernel of lowmem/kernels/triton_kernels.py compiles for a CUDA GPU (sm_90), with no GPU.

The interpreter tests (tests/test_optimizers.py, tests/test_quantized_state.py) run the kernels'
Python on the CPU, which accepts code Triton's compiler refuses (a ``name: tl.constexpr`` re-bound
in an unrolled loop, a ``return`` under a constexpr ``if`` followed by one of another type). This
test runs the compiler itself, to the cubin (Triton's wheel carries ``ptxas``), for an explicit
target: no driver is asked. The arguments have the types the launches give them (address tables
of int64, FP32 maps, Python floats as fp32, ``count`` as i32 or, when it is 1, as the constant 1).

Skipped where Triton is missing, runs in its interpreter (``TRITON_INTERPRET=1``), or cannot compile
a trivial kernel for CUDA here (an old API, no NVIDIA backend, no ptxas): that is this machine's
Triton, not the kernels.
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

TARGET = ("cuda", 90, 32)  # an H100/H200: sm_90, warps of 32


def _quantized(qb: int, **constexprs) -> dict:
    """A quantized kernel's constexprs: QB, the block size (16 .. 4096), and the ROWS of its launch."""
    from lowmem.kernels import triton_kernels as tk

    rows, _ = tk._quantized_launch(qb)
    return {**constexprs, "QB": qb, "ROWS": rows}


# (kernel, constexprs, count is 1): every kernel, both 16-bit dtypes of each, every weight dtype
# and both widths of the quantized ones, the flags on and off, the smallest and largest blocks.
CASES = [
    ("_sgd_kernel", dict(MOMENTUM=True, NESTEROV=True, DECAY=True, STOCHASTIC=True, BF16=True, BLOCK=1024), False),
    ("_sgd_kernel", dict(MOMENTUM=True, NESTEROV=False, DECAY=True, STOCHASTIC=True, BF16=False, BLOCK=1024), False),
    ("_sgd_kernel", dict(MOMENTUM=False, NESTEROV=False, DECAY=False, STOCHASTIC=False, BF16=False, BLOCK=1024), True),
    ("_adam_amax_kernel", dict(BF16=True, BLOCK=1024), False),
    ("_adam_amax_kernel", dict(BF16=False, BLOCK=1024), True),
    ("_adam_kernel", dict(DECAY=True, STOCHASTIC=True, BF16=True, BLOCK=1024), False),
    ("_adam_kernel", dict(DECAY=False, STOCHASTIC=True, BF16=False, BLOCK=1024), False),
    ("_adam_kernel", dict(DECAY=True, STOCHASTIC=False, BF16=False, BLOCK=1024), True),
    ("_sgd_q_kernel", dict(NESTEROV=True, DECAY=True, STOCHASTIC=True, WEIGHTS=0, BITS=8, qb=128), False),
    ("_sgd_q_kernel", dict(NESTEROV=False, DECAY=True, STOCHASTIC=True, WEIGHTS=1, BITS=4, qb=16), False),
    ("_sgd_q_kernel", dict(NESTEROV=True, DECAY=False, STOCHASTIC=False, WEIGHTS=2, BITS=4, qb=4096), True),
    ("_adam_q_kernel", dict(DECAY=True, STOCHASTIC=True, WEIGHTS=1, BITS=8, qb=2048), False),
    ("_adam_q_kernel", dict(DECAY=True, STOCHASTIC=True, WEIGHTS=0, BITS=4, qb=128), True),
    ("_adam_q_kernel", dict(DECAY=False, STOCHASTIC=False, WEIGHTS=2, BITS=8, qb=16), False),
]

POINTERS = {"table": "*i64", "chunk_tensor": "*i32", "chunk_start": "*i64", "scratch": "*fp32",
            "step_sizes": "*fp32", "state_keys": "*i64", "m_map": "*fp32", "m_mids": "*fp32",
            "v_map": "*fp32", "v_mids": "*fp32"}  # fmt: skip
INTEGERS = {"count": "i32"}
FLOATS = {"lr", "momentum", "weight_decay", "grad_scale", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2",
          "eps", "decay"}  # fmt: skip


def _signature(fn, constexprs: dict, count_is_one: bool) -> tuple[dict, dict, dict]:
    """Triton's (signature, constexprs, attrs) of a launch: names to types, (index,) to values, and
    the 16-byte alignment of the pointers that the launcher finds in torch's tensors."""
    signature, values, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs or (name == "count" and count_is_one):
            signature[name] = "constexpr"
            values[(index,)] = constexprs.get(name, 1)
        elif name in POINTERS:
            signature[name] = POINTERS[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in INTEGERS:
            signature[name] = INTEGERS[name]
        else:
            assert name in FLOATS, f"{fn.__name__}'s argument {name}: give it a type in this test"
            signature[name] = "fp32"
    return signature, values, attrs


def _compile(fn, signature: dict, constexprs: dict, attrs: dict, options: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*TARGET), options=options)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The module, once this Triton is known to compile for CUDA here (else a skip), with Triton's
    cache in a fresh folder: every case is compiled, none read back from an earlier run."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: Triton's interpreter, not its compiler")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))

        @triton.jit
        def probe(x, n, BLOCK: tl.constexpr):
            offsets = tl.arange(0, BLOCK)
            tl.store(x + offsets, tl.load(x + offsets, mask=offsets < n) + 1.0, mask=offsets < n)

        try:
            _compile(probe, {"x": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {(2,): 64}, {}, {"num_warps": 4})
        except Exception as error:  # an old API, no NVIDIA backend, no ptxas, ...
            pytest.skip(f"Triton {triton.__version__} cannot compile for CUDA here: {type(error).__name__}: {error}")
        from lowmem.kernels import triton_kernels

        yield triton_kernels


def test_the_cases_cover_every_kernel(kernels):
    defined = {name for name, value in vars(kernels).items()
               if name.endswith("_kernel") and isinstance(value, triton.runtime.JITFunction)}  # fmt: skip
    assert defined == {name for name, _, _ in CASES}


@pytest.mark.parametrize(("name", "constexprs", "count_is_one"), CASES,
                         ids=[f"{name}-{i}" for i, (name, _, _) in enumerate(CASES)])  # fmt: skip
def test_the_kernel_compiles_for_cuda(kernels, name, constexprs, count_is_one):
    if "qb" in constexprs:  # a quantized kernel: QB and the ROWS its launch gives it
        constexprs = _quantized(**constexprs)
    fn = getattr(kernels, name)
    compiled = _compile(fn, *_signature(fn, constexprs, count_is_one), dict(kernels._LAUNCH))
    assert compiled.asm.get("cubin") or compiled.asm.get("ptx")
