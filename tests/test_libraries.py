"""Library settings are per trainer (lowmem/libraries.py): one run's choices never leak into the next
run of the same process, and what the user set stays."""

from __future__ import annotations

import os

import pytest
import torch

from lowmem.config import compose
from lowmem.libraries import CAPPED, configure_libraries
from lowmem.trainer import build_trainer
from tests.helpers import TINY_WRN


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch):
    """No library variable in the environment; torch's switches as they were, afterwards."""
    for name in CAPPED:
        monkeypatch.delenv(name, raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic)
    yield
    configure_libraries(torch.device("cpu"))  # lowmem's own settings undone
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[1:]


def test_a_capped_trainer_after_a_default_one_does_not_benchmark_cudnn():
    build_trainer(compose(*TINY_WRN))
    torch.backends.cudnn.benchmark = True  # what the default trainer's tune_convolutions does on CUDA
    build_trainer(compose(*TINY_WRN, "trainer.workspaces=capped"))
    assert torch.backends.cudnn.benchmark is False


def test_variables_lowmem_set_are_removed_by_a_later_default_trainer():
    build_trainer(compose(*TINY_WRN, "trainer.workspaces=capped"))
    assert {name: os.environ.get(name) for name in CAPPED} == CAPPED
    build_trainer(compose(*TINY_WRN, "trainer.deterministic=true"))
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    assert "CUDNN_CONV_WSCAP_DBG" not in os.environ and "CUBLASLT_WORKSPACE_SIZE" not in os.environ
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    build_trainer(compose(*TINY_WRN))
    assert not any(name in os.environ for name in CAPPED)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic


def test_the_users_own_settings_are_left_alone(monkeypatch):
    torch.use_deterministic_algorithms(True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    build_trainer(compose(*TINY_WRN))
    assert torch.are_deterministic_algorithms_enabled()
    build_trainer(compose(*TINY_WRN, "trainer.workspaces=capped"))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["CUDNN_CONV_WSCAP_DBG"] == "4"
    build_trainer(compose(*TINY_WRN, "trainer.deterministic=true"))
    build_trainer(compose(*TINY_WRN))
    assert torch.are_deterministic_algorithms_enabled()  # before lowmem, and after it: the user's
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "CUDNN_CONV_WSCAP_DBG" not in os.environ


def test_a_setting_the_user_changes_after_lowmem_becomes_the_users():
    configure_libraries(torch.device("cpu"), "capped")
    os.environ["CUDNN_CONV_WSCAP_DBG"] = "64"  # the user's now
    configure_libraries(torch.device("cpu"))
    assert os.environ["CUDNN_CONV_WSCAP_DBG"] == "64" and "CUBLASLT_WORKSPACE_SIZE" not in os.environ
    del os.environ["CUDNN_CONV_WSCAP_DBG"]
