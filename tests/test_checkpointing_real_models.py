"""Checkpointing on the models people train, through ``lowmem.prepare``: Hugging Face transformers
(GPT-2 and Llama with their default ``use_cache=True``, T5 and BART whose layers return tuples) and
torchvision's plain-layer chains (VGG, AlexNet). In FP64, one SGD step gives plain PyTorch's
weights: bit-identical where the order of the arithmetic is the same, else within 1e-10 relative
(T5 and BART: the gradients of what every block reads — T5's position bias, the encoder output the
decoder layers attend to — are summed over the blocks in another order)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmem

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")

SGD = ["precision=fp64", "trainer.device=cpu", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0",
       "optim.nesterov=false", "optim.weight_decay=0"]  # fmt: skip
STRATEGIES = {
    "residual": ["checkpointing.strategy=residual"],
    "residual_star": ["checkpointing.strategy=residual_star"],
    "optimal": ["checkpointing.strategy=optimal", "checkpointing.budget_mb=1000"],
}


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=100, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def t5() -> nn.Module:
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.1)  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def bart() -> nn.Module:
    config = transformers.BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1)  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def lm_batch(target_length: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (3, 12), generator=generator)
    labels = ids.clone() if target_length == 12 else torch.randint(1, 100, (3, target_length), generator=generator)
    return {"input_ids": ids, "labels": labels}


def plain_step(model: nn.Module, loss: Callable, batch) -> dict[str, torch.Tensor]:
    """The state after one plain FP64 SGD step (lr 0.1) from the seed lowmem's step starts from."""
    model = copy.deepcopy(model).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    loss(model, batch).backward()
    optimizer.step()
    return model.state_dict()


def lowmem_step(model: nn.Module, loss: Callable, batch, overrides: list[str]):
    run = lowmem.prepare(copy.deepcopy(model), loss, batch, overrides=SGD + overrides)
    torch.manual_seed(0)
    run.step(batch)
    return run


def assert_same_weights(got: dict, want: dict, exact: bool) -> None:
    """Every floating-point entry equal (``exact``) or within 1e-10 of the entry's largest
    magnitude, floored at 1e-8: a weight whose gradient is zero in exact arithmetic (BART's key
    biases) moves by rounding noise of ~1e-18 only."""
    for name, value in want.items():
        if not value.is_floating_point():
            assert torch.equal(got[name], value), name
        elif exact:
            assert torch.equal(got[name].double(), value), name
        else:
            error = (got[name].double() - value).abs().max().item()
            assert error <= 1e-10 * max(value.abs().max().item(), 1e-8), (name, error)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("make", [gpt2, llama])
def test_decoders_with_their_default_cache_step_as_plain(make, strategy):
    torch.manual_seed(0)
    model = make()
    assert model.config.use_cache  # the default this is about
    batch = lm_batch(12)
    run = lowmem_step(model, lm_loss, batch, STRATEGIES[strategy])
    assert_same_weights(run.model.state_dict(), plain_step(model, lm_loss, batch), exact=True)
    assert run.model.config.use_cache  # switched off only while training checkpointed
    run.model.eval()
    with torch.no_grad():  # generation-style use still gets its cache
        assert run.model(input_ids=batch["input_ids"]).past_key_values is not None


def test_a_cache_asked_for_explicitly_is_refused_naming_the_block():
    torch.manual_seed(0)
    batch = lm_batch(12)

    def cached_loss(model, batch):
        return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=True).loss

    run = lowmem.prepare(gpt2(), cached_loss, batch, overrides=SGD + STRATEGIES["residual"])
    before = copy.deepcopy(run.model.state_dict())
    refusal = r"block transformer\.h\.0 \(GPT2Block\) changes its argument 1 \(DynamicCache\).*checkpointing\.blocks"
    with pytest.raises(ValueError, match=refusal):
        run.step(batch)
    assert_same_weights(run.model.state_dict(), before, exact=True)


@pytest.mark.parametrize("strategy", ["residual", "residual_star"])
@pytest.mark.parametrize("make", [t5, bart])
def test_encoder_decoders_whose_layers_return_tuples_step_as_plain(make, strategy):
    torch.manual_seed(0)
    model = make()
    batch = lm_batch(7)
    run = lowmem_step(model, lm_loss, batch, STRATEGIES[strategy])
    assert_same_weights(run.model.state_dict(), plain_step(model, lm_loss, batch), exact=False)


def classification_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def small_head(name: str) -> nn.Module:
    """A torchvision VGG / AlexNet whose 4096-wide classifier is one dropout and linear layer (its
    features, the plain-layer chain, as torchvision builds them): seconds per FP64 step on a CPU."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    width = next(m for m in model.classifier if isinstance(m, nn.Linear)).in_features
    model.classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(width, 10))
    return model


@pytest.mark.parametrize("strategy", ["residual", "residual_star"])
@pytest.mark.parametrize("name, size", [("vgg11", 32), ("vgg11_bn", 32), ("alexnet", 64)])
def test_torchvision_plain_layer_chains_step_as_plain(name, size, strategy):
    """AlexNet's 11x11/4 stem and three poolings need at least a 63x63 image."""
    model = small_head(name)
    batch = (torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(3)), torch.tensor([1, 7]))
    run = lowmem.prepare(copy.deepcopy(model), classification_loss, batch, overrides=SGD + STRATEGIES[strategy])
    calls = []
    run.model.features[0].register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(0)
    run.step(batch)
    assert len(calls) == 2  # forward, and recomputation in backward: checkpointed
    want = plain_step(model, classification_loss, (batch[0].double(), batch[1]))
    assert_same_weights(run.model.state_dict(), want, exact=True)  # BatchNorm statistics included


def test_a_models_own_composite_children_are_its_chain_when_it_has_no_container_of_blocks():
    """Inception v3 calls its blocks as attributes (Conv2d_1a_3x3 .. Mixed_7c), in no container."""
    from lowmem.techniques.chains import find_block_chains
    from tests.conformance_models import ConformanceModel, _images, _seeded, classify
    from tests.test_conformance import Case, conformance

    def build() -> nn.Module:
        return torchvision.models.inception_v3(num_classes=10, aux_logits=False, init_weights=True, dropout=0.0)

    (chain,) = find_block_chains(build())
    assert chain.names[0] == "Conv2d_1a_3x3" and chain.names[-1] == "Mixed_7c" and len(chain.names) == 16
    model = ConformanceModel("inception_v3", "torchvision", _seeded(build), classify, _images(2, 75))
    case = Case("residual_star", ("checkpointing.strategy=residual_star", "checkpointing.every=2"), "equal")
    assert conformance(model, case).startswith("equal")
