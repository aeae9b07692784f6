"""How convolution models run fast on CUDA: channels-last activations in 16 bits, tuned cuDNN algorithms.

Only on CUDA; on a CPU nothing here changes anything (layout, kernels, results).

- ``input_memory_format``: FP16/BF16 inputs on CUDA are laid out channels-last (NHWC). Tensor-core
  convolutions compute in NHWC; given NCHW activations cuDNN either transposes every input and
  output or falls back to slower kernels (a likely part of why pure FP16 measured slower than
  FP32 there). A convolution's output takes its input's layout, and BatchNorm, ReLU, the residual
  additions, zero-padded shortcuts and pooling keep it, so laying out the input batch is enough
  for every activation — in the recomputations of activation checkpointing and in compact sparse
  convolutions too (``tests/test_replay.py`` follows every convolution's input). Gradients mostly
  follow; WRN's subsampling shortcut (``x[:, :, ::2, ::2]``) is the exception: slicing's backward
  allocates an NCHW gradient, so the stages before each downsampling block backpropagate NCHW
  gradients, which cuDNN converts where they reach a convolution.
  The weights stay NCHW: the fused 16-bit optimizer updates parameters, gradients and state as
  flat contiguous buffers (``lowmem.kernels``), and masked sparsity indexes weights flat. cuDNN
  reads each weight in NHWC with one small copy per call (a compact sparse weight is built per
  call anyway), and the weight gradient is accumulated into the NCHW gradient. Inside a replayed
  CUDA graph (``lowmem.techniques.replay``) these copies cost no launch overhead.
- ``tune_convolutions``: ``torch.backends.cudnn.benchmark`` for models with 2-D convolutions on
  CUDA. Their inputs take a handful of shapes (the microbatch, a short last microbatch, the
  evaluation batch), each timed once on first use, after which cuDNN runs the fastest algorithm
  for it instead of a heuristic's pick. Timing happens in eager passes, never inside a CUDA graph
  capture (the replaying runner warms each shape up first). Algorithms may then differ between
  processes, so CUDA runs are not bitwise reproducible across processes (they were not
  guaranteed to be: cuDNN's backward kernels use atomics); a run that asks for determinism
  (``trainer.deterministic=true`` sets ``torch.backends.cudnn.deterministic``) is left untimed, and
  so is a run with ``trainer.workspaces=capped``: the timing borrows scratch memory from the
  allocator, which the measured peak would count.
"""

from __future__ import annotations

import torch
from torch import nn

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def input_memory_format(dtype: torch.dtype, device: torch.device) -> torch.memory_format:
    """The memory format for image batches of ``dtype`` on ``device``: channels-last for FP16/BF16
    on CUDA, otherwise as they are (``torch.preserve_format``)."""
    if torch.device(device).type == "cuda" and dtype in _SIXTEEN_BIT:
        return torch.channels_last
    return torch.preserve_format


def tune_convolutions(model: nn.Module, device: torch.device, workspaces: str = "default") -> bool:
    """Let cuDNN time its algorithms for each input shape if ``model`` has 2-D convolutions and runs
    on CUDA, unless cuDNN was asked to be deterministic (a process-wide setting) or library
    workspaces are capped (``trainer.workspaces``). Returns whether it did."""
    if torch.device(device).type != "cuda" or torch.backends.cudnn.deterministic or workspaces != "default":
        return False
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return False
    torch.backends.cudnn.benchmark = True
    return True
