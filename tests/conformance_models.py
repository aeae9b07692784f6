"""The conformance suite's models: small configurations of the model libraries users train most.

Each entry builds a fresh model from a config (random initialisation, seeded, nothing downloaded)
with its loss and an example batch. Dropout is off, so that a step is a function of the weights and
the batch alone and FP64 runs can be compared with plain PyTorch to the last bits. Used by
tests/test_conformance.py and scripts/conformance_table.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ConformanceModel:
    """A model of a library: ``build()`` returns it (seeded), ``loss(model, batch)`` its mean loss."""

    name: str
    library: str
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    batch: Callable[[], Any]
    has_batchnorm: bool = False
    norm_relu_conv: bool = False  # has BatchNorm -> ReLU -> Conv2d sequences (``no_bn`` applies)


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return seeded


def _images(examples: int = 4, size: int = 32) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        return torch.randn(examples, 3, size, size, generator=generator), torch.randint(0, 10, (examples,),
                                                                                      generator=generator)

    return batch


def _tokens(examples: int = 4, length: int = 12, vocab: int = 96) -> Callable[[], dict[str, torch.Tensor]]:
    def batch() -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(2, vocab, (examples, length), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}

    return batch


def _sentences(examples: int = 4, length: int = 12, vocab: int = 96) -> Callable[[], dict[str, torch.Tensor]]:
    def batch() -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        return {"input_ids": torch.randint(2, vocab, (examples, length), generator=generator),
                "labels": torch.randint(0, 3, (examples,), generator=generator)}

    return batch


def classify(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross-entropy of an image classifier (a tensor out, or a ``.logits`` output)."""
    images, labels = batch
    out = model(images)
    return F.cross_entropy(getattr(out, "logits", out), labels)


def hugging_face_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A transformers model's own loss (``labels`` in the batch)."""
    return model(**batch).loss


def _transformers() -> list[ConformanceModel]:
    import transformers as hf

    logging.getLogger("transformers").setLevel(logging.ERROR)
    small = {"vocab_size": 96}
    gpt2 = hf.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, **small)
    llama = hf.LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
                           pad_token_id=1, **small)
    bert = hf.BertConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         num_labels=3, pad_token_id=0, **small)
    t5 = hf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                     dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **small)
    vit = hf.ViTConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       image_size=32, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       num_labels=10)
    return [
        ConformanceModel("gpt2", "transformers", _seeded(lambda: hf.GPT2LMHeadModel(gpt2)), hugging_face_loss,
                         _tokens()),
        ConformanceModel("llama", "transformers", _seeded(lambda: hf.LlamaForCausalLM(llama)), hugging_face_loss,
                         _tokens()),
        ConformanceModel("bert", "transformers", _seeded(lambda: hf.BertForSequenceClassification(bert)),
                         hugging_face_loss, _sentences()),
        ConformanceModel("t5", "transformers", _seeded(lambda: hf.T5ForConditionalGeneration(t5)),
                         hugging_face_loss, _tokens()),
        ConformanceModel("vit", "transformers", _seeded(lambda: hf.ViTForImageClassification(vit)), classify,
                         _images()),
    ]


def _timm() -> list[ConformanceModel]:
    import timm

    def create(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
        return _seeded(lambda: timm.create_model(name, num_classes=10, pretrained=False, drop_rate=0.0,
                                                 drop_path_rate=0.0, **kwargs))

    return [
        ConformanceModel("resnet10t", "timm", create("resnet10t"), classify, _images(), has_batchnorm=True,
                         norm_relu_conv=True),
        ConformanceModel("vit_tiny", "timm", create("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3),
                         classify, _images()),
        # ConvNeXt-Atto's blocks at a quarter of its depth and width (its 7x7 depthwise convolutions are
        # FP64's slowest op on a CPU): the same block code, seconds per case.
        ConformanceModel("convnext", "timm", create("convnext_atto", depths=(1, 1, 2, 1), dims=(16, 32, 64, 128)),
                         classify, _images()),
        ConformanceModel("efficientnet_b0", "timm", create("efficientnet_b0"), classify, _images(),
                         has_batchnorm=True),
        ConformanceModel("swin", "timm", create("swin_tiny_patch4_window7_224", img_size=32, patch_size=2,
                                                window_size=4, depths=(2, 2), num_heads=(1, 2), embed_dim=16),
                         classify, _images()),
    ]


def conformance_models() -> list[ConformanceModel]:
    """Every model of the suite whose library is installed (``pip install -e '.[models]'``)."""
    found: list[ConformanceModel] = []
    for library in (_transformers, _timm):
        try:
            found.extend(library())
        except ImportError:
            continue
    return found
