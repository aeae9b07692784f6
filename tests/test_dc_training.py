"""The dc_iwslt recipe's techniques against a reference, through the trainer (SPEC §3.2, §6):

- true microbatching in tokens (each microbatch's loss weighted by its share of target tokens) equals
  the full minibatch in float64, the last microbatch short;
- residual checkpointing gives the same gradients as none with every dropout on (recomputation
  replays the random stream), also combined with microbatching as in Table 4, with either ``model.ops``.
"""

from __future__ import annotations

import pytest
import torch

from lowmem.config import ConfigError
from lowmem.techniques import head_loss
from lowmem.trainer import build_trainer
from tests.helpers import SMALL_DC, make_config

NO_DROPOUT = ("model.dropout=0.0", "model.weight_dropout=0.0", "model.attention_dropout=0.0")


def gradients(*overrides: str, state: dict | None = None) -> tuple[list[torch.Tensor], int, dict]:
    """One minibatch's forward and backward (no update) under ``overrides``: the parameter gradients,
    the number of microbatches run and the initial state dict (pass it back to start alike)."""
    trainer = build_trainer(make_config(*SMALL_DC, "precision=fp64", *overrides))
    model = trainer.unwrapped_model
    if state is not None:
        model.load_state_dict(state)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    batch = trainer.example_batch()
    parts = trainer.microbatches(batch)
    torch.manual_seed(7)
    for index, (part, weight) in enumerate(parts):
        trainer.microbatch_backward(part, weight, index, len(parts))
    return [p.grad.clone() for p in model.parameters()], len(parts), state


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_true_token_microbatching_equals_the_full_batch_in_fp64():
    full, parts, state = gradients(*NO_DROPOUT)
    assert parts == 1
    micro, parts, _ = gradients(*NO_DROPOUT, "microbatch.size=200", "microbatch.mode=true", state=state)
    assert parts > 2  # several microbatches, of unequal token counts
    assert max_difference(full, micro) <= 1e-12


@pytest.mark.parametrize("ops", ["current", "pytorch_1_0"])
@pytest.mark.parametrize("every", [1, 2])
def test_residual_checkpointing_gives_the_same_gradients_with_dropout_on(ops, every):
    plain, _, state = gradients(f"model.ops={ops}")
    checkpointed, _, _ = gradients(
        f"model.ops={ops}", "checkpointing.strategy=residual", f"checkpointing.every={every}", state=state
    )
    assert max_difference(plain, checkpointed) <= 1e-12


def test_table4_combination_microbatches_and_checkpointing_equals_the_plain_full_batch():
    full, _, state = gradients(*NO_DROPOUT)
    combined, parts, _ = gradients(
        *NO_DROPOUT, "microbatch.size=200", "microbatch.mode=true", "checkpointing.strategy=residual",
        "checkpointing.every=1", state=state,
    )
    assert parts > 2
    assert max_difference(full, combined) <= 1e-12


def test_a_microbatch_smaller_than_the_longest_sentence_is_refused_naming_the_pair():
    with pytest.raises(ConfigError) as error:
        build_trainer(make_config(*SMALL_DC, "precision=fp64", "microbatch.size=100"))
    message = str(error.value)
    assert message.startswith("microbatch.size=100 tokens is smaller than training pair ")
    assert "set microbatch.size to at least 126" in message  # the generated corpus's longest pair


@pytest.mark.parametrize("extra", [(), ("sparsity.density=0.3",), ("microbatch.size=200", "microbatch.mode=true",
                                                                    "checkpointing.strategy=residual")],
                         ids=["dense", "compact-sparse", "microbatch-checkpointing"])
def test_the_chunked_head_and_loss_give_the_unchunked_gradients(extra, monkeypatch):
    """loss.chunk_tokens: the output projection (compact sparse too) and the label-smoothed loss a
    chunk of tokens at a time give the unchunked gradients in FP64, dropout on."""
    plain, _, state = gradients("loss.chunk_tokens=none", *extra)
    nodes = []
    original = head_loss._LinearCrossEntropy.apply
    monkeypatch.setattr(head_loss._LinearCrossEntropy, "apply", lambda *a: nodes.append(a[8]) or original(*a))
    chunked, parts, _ = gradients("loss.chunk_tokens=16", *extra, state=state)
    assert len(nodes) == parts and set(nodes) == {16}  # the chunked node ran, 16 tokens a chunk
    assert max_difference(plain, chunked) <= 1e-12
