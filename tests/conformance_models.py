"""The conformance suite's models: small configurations of the model libraries users train most.

Each entry builds a fresh model from a config (random initialisation, seeded, nothing downloaded)
with its loss and an example batch. Dropout is off, so that a step is a function of the weights and
the batch alone and FP64 runs can be compared with plain PyTorch to the last bits. Used by
tests/test_conformance.py and scripts/conformance_table.py.
"""

from __future__ import annotations

import importlib.util
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
    trains_batch: Callable[[], Any] | None = None  # the batch of the "trains" cases (default: ``batch``)


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


def attention_entropy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A transformers model's loss plus an entropy penalty on its attention maps (``output_attentions``):
    a loss on tensors the layers hand out by hooks, not by their outputs."""
    out = model(**batch, output_attentions=True)
    maps = [a.to(torch.promote_types(a.dtype, torch.float32)) for a in out.attentions]  # 16-bit: in FP32
    return out.loss + 0.1 * sum(-(a * a.clamp_min(1e-12).log()).sum(-1).mean() for a in maps)


def _capture_output(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    """A user's forward hook keeping a block's inner feature for the loss (feature distillation)."""
    module.captured = output


def _with_hooked_mlps(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(_capture_output)
    return model


def hooked_feature_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's loss plus a penalty on the features its forward hooks captured inside the blocks."""
    loss = model(**batch).loss
    features = [module.__dict__.pop("captured") for module in model.modules() if "captured" in module.__dict__]
    return loss + 0.5 * sum(f.pow(2).mean() for f in features)


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
    # Its router's load-balancing loss on (collected by transformers' hooks inside each layer); eager
    # experts: the grouped ones have no FP64 kernel on a CPU.
    mixtral = hf.MixtralConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=16, output_router_logits=True, router_aux_loss_coef=0.05,
                               experts_implementation="eager", bos_token_id=0, eos_token_id=1, pad_token_id=1,
                               **small)
    eager_llama = hf.LlamaConfig(**{**llama.to_dict(), "attn_implementation": "eager"})
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
        ConformanceModel("mixtral router loss", "transformers", _seeded(lambda: hf.MixtralForCausalLM(mixtral)),
                         hugging_face_loss, _tokens()),
        ConformanceModel("llama attention loss", "transformers", _seeded(lambda: hf.LlamaForCausalLM(eager_llama)),
                         attention_entropy_loss, _tokens()),
        ConformanceModel("llama hooked features", "transformers",
                         _seeded(lambda: _with_hooked_mlps(hf.LlamaForCausalLM(llama))), hooked_feature_loss,
                         _tokens()),
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
        # Trained on 64 x 64 images: its last BatchNorms see 2 x 2 positions per example (at 32 x 32,
        # one: under simulated microbatches of 2 they normalize 2 values, and whether 4 Adam updates
        # lowered the loss was decided by the thread count's rounding). Compared in FP64 at 32 x 32.
        ConformanceModel("efficientnet_b0", "timm", create("efficientnet_b0"), classify, _images(),
                         has_batchnorm=True, trains_batch=_images(size=64)),
        ConformanceModel("swin", "timm", create("swin_tiny_patch4_window7_224", img_size=32, patch_size=2,
                                                window_size=4, depths=(2, 2), num_heads=(1, 2), embed_dim=16),
                         classify, _images()),
    ]


def denoising_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A diffusion model's noise-prediction loss: (noisy images, timesteps, noise)."""
    images, timesteps, noise = batch
    return F.mse_loss(model(images, timesteps).sample, noise)


def _noisy_images(examples: int = 4, size: int = 16) -> Callable[[], tuple[torch.Tensor, ...]]:
    def batch() -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(1)
        return (torch.randn(examples, 3, size, size, generator=generator),
                torch.randint(0, 1000, (examples,), generator=generator),
                torch.randn(examples, 3, size, size, generator=generator))

    return batch


# The libraries' model modules load when a model is built, not when the tests are collected (diffusers'
# UNet2DModel took 5.7 s of each test process's collection, peft 2.2 s on a Zen 3 core).


def _diffusers() -> list[ConformanceModel]:
    import diffusers

    logging.getLogger("diffusers").setLevel(logging.ERROR)

    def unet() -> nn.Module:
        # Its down and up blocks are called with keyword arguments only.
        return diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                           block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                           up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=8,
                           dropout=0.0)

    return [ConformanceModel("unet2d", "diffusers", _seeded(unet), denoising_loss, _noisy_images())]


def _peft() -> list[ConformanceModel]:
    import transformers as hf

    if importlib.util.find_spec("peft") is None:
        raise ImportError("peft")

    llama = hf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
                           pad_token_id=1, vocab_size=96)

    def lora() -> nn.Module:
        import peft

        base = hf.LlamaForCausalLM(llama)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         lora_dropout=0.0))

    return [ConformanceModel("lora llama", "peft", _seeded(lora), hugging_face_loss, _tokens())]


def conformance_models() -> list[ConformanceModel]:
    """Every model of the suite whose library is installed (``pip install -e '.[models]'``)."""
    found: list[ConformanceModel] = []
    for library in (_transformers, _timm, _diffusers, _peft):
        try:
            found.extend(library())
        except ImportError:
            continue
    return found
