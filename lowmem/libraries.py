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

Every trainer of a process (``gpu_check.py`` and the planner build many) gets its own settings:
each call puts every setting at the value this run decides, and what an earlier run of lowmem set
and this one does not want goes back to what it was before lowmem touched it (a variable lowmem
set is removed again). A setting the user made (``torch.use_deterministic_algorithms(True)``, an
environment variable) is never changed unless this run needs another value (``capped`` or
``deterministic`` turning cuDNN benchmarking off), and then it is restored by a later run that
does not.
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
    for name in sorted(set(CAPPED) | {"CUBLAS_WORKSPACE_CONFIG"}):
        current = _apply(f"env:{name}", wanted.get(name))
        if current is not None:
            in_force[name] = current
            if name in wanted and current != wanted[name]:
                log.info("%s=%s is set in the environment; trainer.workspaces/deterministic would set %s", name,
                         current, wanted[name])
    if device.type == "cuda" and wanted and torch.cuda.is_initialized():
        log.warning(
            "CUDA was already in use in this process: library workspaces created before this run keep their "
            "sizes (%s apply to new ones only)", ", ".join(sorted(wanted)),
        )
    # False is no choice of a run (the library's default): a user's True stays.
    _apply("deterministic_algorithms", True if deterministic else None)
    _apply("cudnn.deterministic", True if deterministic else None)
    # cuDNN's timing borrows scratch memory (capped) and picks algorithms by speed (deterministic);
    # otherwise tune_convolutions decides for the model it sees.
    _apply("cudnn.benchmark", False if deterministic or workspaces == "capped" else None, force=True)
    return in_force


# --- one process, many runs: what lowmem set, and what was there before it ---------------------------

_NOT_SET = object()  # an environment variable that is absent
_ours: dict[str, object] = {}  # setting -> the value lowmem put there
_before: dict[str, object] = {}  # setting -> its value before lowmem first changed it


def _read(setting: str) -> object:
    if setting.startswith("env:"):
        return os.environ.get(setting[4:], _NOT_SET)
    if setting == "deterministic_algorithms":
        return torch.are_deterministic_algorithms_enabled()
    return getattr(torch.backends.cudnn, setting.split(".")[1])


def _write(setting: str, value: object) -> None:
    if setting.startswith("env:"):
        if value is _NOT_SET:
            os.environ.pop(setting[4:], None)
        else:
            os.environ[setting[4:]] = str(value)
    elif setting == "deterministic_algorithms":
        torch.use_deterministic_algorithms(bool(value))
    else:
        setattr(torch.backends.cudnn, setting.split(".")[1], bool(value))


def _apply(setting: str, value: object | None, force: bool = False) -> str | None:
    """Put ``setting`` at ``value`` for this run (None: this run has no say) and return the
    environment variable's value in force (None when absent). A value the user set stays unless
    ``force`` (the run cannot work with it); what lowmem set before and this run does not want
    returns to the value it replaced."""
    current = _read(setting)
    if setting in _ours and current != _ours[setting]:  # changed since lowmem set it: the user's now
        del _ours[setting], _before[setting]
    user_set = setting not in _ours and current not in (_NOT_SET, False)
    if value is None or (user_set and not force):
        if setting in _ours:  # an earlier run's choice: undone
            _write(setting, _before.pop(setting))
            del _ours[setting]
    else:
        _before.setdefault(setting, current)
        _ours[setting] = value
        _write(setting, value)
    now = _read(setting)
    return None if now is _NOT_SET or not setting.startswith("env:") else str(now)
