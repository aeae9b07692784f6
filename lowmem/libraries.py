"""The CUDA math libraries' settings a run chooses: workspace sizes and determinism.

cuBLAS, cuBLASLt and cuDNN take scratch memory ("workspaces") from PyTorch's caching allocator, so
it counts in the measured peak (``torch.cuda.max_memory_allocated``) though no tensor holds it:
cuBLAS keeps one workspace per handle and stream (32 MiB each on Hopper by PyTorch's default, one
for the forward thread and one for autograd's device thread), cuBLASLt one more, and a cuDNN
convolution borrows as much as its chosen algorithm wants for the duration of a call. In a run that
fits in a few MB, that is most of the peak.

``trainer.workspaces``:

- ``default``: the libraries' and PyTorch's own choices (fastest);
- ``capped``: cuBLAS workspaces of 16 KiB x 8 (``CUBLAS_WORKSPACE_CONFIG=:16:8``), a cuBLASLt workspace
  of 128 KiB (``CUBLASLT_WORKSPACE_SIZE``, KiB), and cuDNN convolution algorithms restricted to those
  needing at most 4 MiB (``CUDNN_CONV_WSCAP_DBG``, MiB) — slower kernels may be chosen.

``trainer.deterministic=true`` makes a CUDA run repeat bit for bit (and so lets a resumed run end
bit-identical to an uninterrupted one, as it does on CPU): deterministic algorithms only
(``torch.use_deterministic_algorithms``, which raises on an operation that has none), cuDNN's
deterministic algorithms without benchmarking, and a cuBLAS workspace configuration that cuBLAS
needs for reproducible results (``:4096:8``, or ``capped``'s ``:16:8``).

The environment variables are read when a library first runs in the process (PyTorch caches the
cuBLAS workspace size on first use), so they are set before the model touches the device; a
variable the user has set is left as it is. On a machine without CUDA only the determinism
switch matters (CPU kernels are deterministic already).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("lowmem")

WORKSPACES = ("default", "capped")
# Environment of the capped workspaces: cuBLAS ":KiB:count" pairs, cuBLASLt KiB, cuDNN MiB.
CAPPED = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "128", "CUDNN_CONV_WSCAP_DBG": "4"}
# cuBLAS's reproducible-results configurations (either may be set for determinism).
_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def library_environment(workspaces: str, deterministic: bool) -> dict[str, str]:
    """The environment variables ``workspaces`` and ``deterministic`` ask for (before the user's own)."""
    if workspaces not in WORKSPACES:
        raise ValueError(f"trainer.workspaces={workspaces!r} is unknown; allowed: {', '.join(WORKSPACES)}")
    wanted = dict(CAPPED) if workspaces == "capped" else {}
    if deterministic:
        wanted.setdefault("CUBLAS_WORKSPACE_CONFIG", _DETERMINISTIC_CUBLAS[0])
    return wanted


def configure_libraries(
    device: torch.device, workspaces: str = "default", deterministic: bool = False
) -> dict[str, str]:
    """Apply ``trainer.workspaces`` and ``trainer.deterministic`` for a run on ``device``; returns the
    library environment in force (what was set here or already set by the user). ValueError (naming
    the knob) when the user's environment makes a deterministic CUDA run impossible."""
    wanted = library_environment(workspaces, deterministic)
    configured = os.environ.get("CUBLAS_WORKSPACE_CONFIG", _DETERMINISTIC_CUBLAS[0])
    if deterministic and device.type == "cuda" and configured not in _DETERMINISTIC_CUBLAS:
        raise ValueError(
            f"trainer.deterministic=true needs a reproducible cuBLAS workspace, but the environment sets "
            f"CUBLAS_WORKSPACE_CONFIG={configured}: unset it or set one of {', '.join(_DETERMINISTIC_CUBLAS)}"
        )
    in_force = {}
    for name, value in wanted.items():
        current = os.environ.setdefault(name, value)
        in_force[name] = current
        if current != value:
            log.info("%s=%s is set in the environment; trainer.workspaces/deterministic would set %s", name,
                     current, value)
    if device.type == "cuda" and wanted and torch.cuda.is_initialized():
        log.warning(
            "CUDA was already in use in this process: library workspaces created before this run keep their "
            "sizes (%s apply to new ones only)", ", ".join(sorted(wanted)),
        )
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    if deterministic:
        torch.backends.cudnn.benchmark = False
    return in_force
