"""The vision recipe: torchvision models by name, a user's class by ``model._target_``, image sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lowmem.config import ConfigError
from lowmem.train import run
from recipes.vision.models import forward_error
from recipes.vision.recipe import RECIPE, resize
from tests.helpers import ROOT, make_config

TINY_DATA = (
    "data=fake",
    "data.batch_size=10",
    "data.train_size=20",
    "data.test_size=10",
    "trainer.max_steps=1",
    "trainer.device=cpu",
    "trainer.progress=none",
)


class TinyNet(nn.Module):
    """A user's classifier (``model._target_=tests.test_vision_recipe.TinyNet``)."""

    def __init__(self, width: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.body = nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1))
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(images)).mean((2, 3)))


def vision(*overrides: str):
    return make_config("+recipe=vision", *TINY_DATA, *overrides)


def test_resnet18_trains_a_step_and_writes_its_result(tmp_path):
    result = run(vision("model.arch=resnet18"), tmp_path)
    assert result["steps"] == 1 and 0 <= result["final_test_acc"] <= 100
    assert json.loads((tmp_path / "result.json").read_text())["config"]["model"]["arch"] == "resnet18"
    assert "fc.weight" in torch.load(tmp_path / "model.pt", weights_only=True)


def test_resnet18_is_the_default_and_its_edges_stay_dense():
    model = RECIPE.build_model(make_config("+recipe=vision"))
    assert type(model).__name__ == "ResNet" and model.fc.out_features == 10
    names = RECIPE.sparsifiable_weights(model)
    assert "layer1.0.conv1.weight" in names and not {"conv1.weight", "fc.weight"} & set(names)


def test_a_misspelt_arch_names_the_knob_and_the_close_names():
    with pytest.raises(ConfigError, match=r"model.arch='resnt18'.*did you mean resnet18"):
        RECIPE.build_model(vision("model.arch=resnt18"))


def test_arch_and_target_together_are_refused():
    with pytest.raises(ConfigError, match="model.arch='resnet18' and model._target_="):
        RECIPE.build_model(vision("model.arch=resnet18", "model._target_=tests.test_vision_recipe.TinyNet"))


def test_a_user_class_gets_the_other_model_keys():
    model = RECIPE.build_model(vision("model._target_=tests.test_vision_recipe.TinyNet", "+model.width=6"))
    assert isinstance(model, TinyNet) and model.stem.out_channels == 6
    with pytest.raises(ConfigError, match=r"model\.\*: model.depth\).*unexpected keyword argument 'depth'"):
        RECIPE.build_model(vision("model._target_=tests.test_vision_recipe.TinyNet", "+model.depth=3"))


@pytest.mark.parametrize(
    ("target", "error"),
    [
        ("no_such_package.nets.Net", "cannot import no_such_package.nets: ModuleNotFoundError"),
        ("tests.test_vision_recipe.NoSuchNet", "has no attribute 'NoSuchNet'"),
        ("TinyNet", "not a dotted path"),
    ],
)
def test_a_bad_target_names_the_knob(target, error):
    with pytest.raises(ConfigError, match=rf"model._target_='{target}'.*{error}"):
        RECIPE.build_model(vision(f"model._target_={target}"))


def test_a_class_in_the_working_directory_trains_from_the_cli(tmp_path):
    (tmp_path / "mynets.py").write_text(
        textwrap.dedent(
            """
        from torch import nn

        class Net(nn.Module):
            def __init__(self, width=4):
                super().__init__()
                self.features = nn.Sequential(nn.Conv2d(3, width, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
                self.classifier = nn.Linear(width, 10)

            def forward(self, x):
                return self.classifier(self.features(x).flatten(1))
        """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowmem.train",
            "+recipe=vision",
            "model._target_=mynets.Net",
            "+model.width=3",
            *TINY_DATA,
            "trainer.max_steps=2",
            "hydra.run.dir=run",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 2
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert state["features.0.weight"].shape == (3, 3, 3, 3)


def test_a_model_that_needs_larger_images_is_refused_naming_the_size():
    refusal = r"model.arch=vit_b_16 cannot classify images of data.image_size=32: .* is 224; or .*model.image_size="
    with pytest.raises(ConfigError, match=refusal):
        RECIPE.build_model(vision("model.arch=vit_b_16"))
    with pytest.raises(ConfigError, match="data.image_size=0"):
        RECIPE.build_model(vision("data.image_size=0"))


def test_image_size_resizes_each_batch_on_the_device():
    cfg = vision("model.arch=alexnet", "data.image_size=64")  # alexnet needs at least 63 pixels
    data = RECIPE.build_data(cfg, torch.device("cpu"), torch.float32)
    images, labels = next(iter(data.train.epoch(0)))
    assert images.shape == (10, 3, 64, 64) and labels.shape == (10,)
    assert next(iter(data.test.epoch(0)))[0].shape == (10, 3, 64, 64)
    assert data.resident[0].shape[-2:] == (32, 32)  # the data set itself stays 32x32
    model = RECIPE.build_model(cfg)
    assert RECIPE.loss(model, (images, labels)).dim() == 0


def test_resize_keeps_dtype_and_constant_images():
    images = torch.full((2, 3, 32, 32), 1.5, dtype=torch.bfloat16)
    for size in (16, 48):
        resized = resize(images, size)
        assert resized.dtype == torch.bfloat16 and resized.shape == (2, 3, size, size)
        assert torch.equal(resized, torch.full_like(resized, 1.5))


def test_the_real_probe_changes_neither_the_model_nor_the_random_numbers():
    layers = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(4 * 30 * 30, 10)
    model = nn.Sequential(*layers)
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    random_state = torch.get_rng_state()
    assert forward_error(model, 32, 10) is None
    assert forward_error(model, 1, 10).startswith("RuntimeError")  # 3x3 kernel on a 1x1 image
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(torch.get_rng_state(), random_state) and not model.training
