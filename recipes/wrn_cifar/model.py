"""WideResNet-d-k with pre-activation basic blocks and identity ("option A") shortcuts.

The report's WRN-28-2 (SPEC §3.1): first conv 3→16, three stages of 16k/32k/64k channels with
(d-4)/6 blocks each, BN-ReLU, global average pooling, fc. Where a block changes shape, the
shortcut subsamples spatially and zero-pads channels, so the model has no 1x1 convs:
WRN-28-2 has 1,456,858 parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowmem.residual import norm_relu_conv, run_residual_blocks


class PreActBlock(nn.Module):
    """BN-ReLU-conv3x3-BN-ReLU-conv3x3 plus an identity shortcut.

    Both BN-ReLU-conv triples go through ``lowmem.residual.norm_relu_conv``, so the ``no_bn`` and
    ``residual_star`` checkpointing strategies can recompute the BN-ReLU outputs in backward
    instead of storing them. Attribute names (``bn1``, ``conv1``, ``bn2``, ``conv2``) are state
    dict keys and must not change.
    """

    routes_norm_relu_conv = True
    residual_branch_ends_with_norm_relu_conv = True  # conv2's output is only added to the shortcut

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.in_channels, self.out_channels, self.stride = in_channels, out_channels, stride
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        extra = self.out_channels - self.in_channels
        if extra > 0:
            x = F.pad(x, (0, 0, 0, 0, 0, extra))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = norm_relu_conv(self, self.bn1, self.conv1, x)
        out = norm_relu_conv(self, self.bn2, self.conv2, out)
        return out + self.shortcut(x)


class WideResNet(nn.Module):
    """WRN-depth-width for 32x32 images. ``residual_blocks`` lists all blocks in forward order."""

    def __init__(self, depth: int = 28, width: int = 2, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        if depth < 10 or (depth - 4) % 6 != 0:
            raise ValueError(
                f"model.depth={depth}: a WideResNet needs depth = 6n + 4 with n >= 1 (10, 16, 22, 28, ...)"
            )
        if width < 1:
            raise ValueError(f"model.width={width}: must be a positive integer")
        blocks_per_stage = (depth - 4) // 6
        channels = [16, 16 * width, 32 * width, 64 * width]
        self.conv1 = nn.Conv2d(in_channels, channels[0], 3, padding=1, bias=False)
        blocks = []
        for stage in range(3):
            for i in range(blocks_per_stage):
                in_ch = channels[stage] if i == 0 else channels[stage + 1]
                stride = 2 if (stage > 0 and i == 0) else 1
                blocks.append(PreActBlock(in_ch, channels[stage + 1], stride))
        self.residual_blocks = nn.ModuleList(blocks)
        self.bn = nn.BatchNorm2d(channels[3])
        self.fc = nn.Linear(channels[3], num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.kaiming_uniform_(module.weight, a=5**0.5)
                nn.init.zeros_(module.bias)

    def sparsifiable_weights(self) -> list[str]:
        """Names of the weights DSR may sparsify: the 3x3 convs inside the residual blocks."""
        return [
            f"residual_blocks.{i}.{conv}.weight"
            for i in range(len(self.residual_blocks))
            for conv in ("conv1", "conv2")
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = run_residual_blocks(self, x)
        x = F.relu(self.bn(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)
