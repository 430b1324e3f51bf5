"""Small CNNs for 32×32 images, used by the lessons.

Both accept channels_last input: convert with `model.to(memory_format=torch.channels_last)`.
"""

from __future__ import annotations

import torch
from torch import nn


def conv_bn(in_channels: int, out_channels: int) -> nn.Sequential:
    """3×3 convolution → BatchNorm → GELU. The conv has no bias: BatchNorm's shift replaces it."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.GELU(),
    )


class ConvGroup(nn.Sequential):
    """conv_bn → 2×2 max-pool (halves H and W) → conv_bn: one stage of the fast CNN."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(conv_bn(in_channels, out_channels), nn.MaxPool2d(2), conv_bn(out_channels, out_channels))


class FastCNN(nn.Sequential):
    """The airbench family of fast CIFAR-10 networks: a stem and three conv groups.

    Shapes for a (B, 3, 32, 32) input and width w:
    stem (B, w, 32, 32) → (B, 2w, 16, 16) → (B, 4w, 8, 8) → (B, 4w, 4, 4) → max over space
    (B, 4w) → linear (B, classes). The logits are scaled down, as in airbench, which keeps
    the softmax from saturating early; ×1/2 learned fastest with SGD at lr 0.1 for batch 64
    on the shapes dataset (airbench's ×1/8 goes with its much larger learning rate).
    """

    def __init__(self, width: int = 64, num_classes: int = 10, logit_scale: float = 0.5):
        if width <= 0 or num_classes <= 0:
            raise ValueError(f"width and num_classes must be positive, got {width} and {num_classes}.")
        super().__init__(
            conv_bn(3, width),
            ConvGroup(width, 2 * width),
            ConvGroup(2 * width, 4 * width),
            ConvGroup(4 * width, 4 * width),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * width, num_classes, bias=False),
        )
        self.logit_scale = logit_scale

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return super().forward(images) * self.logit_scale


def fast_cnn(width: int = 64, num_classes: int = 10) -> FastCNN:
    """The kit's fast CNN (about 1.9 M parameters at width 64, 0.12 M at width 16)."""
    return FastCNN(width, num_classes)


def resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 adapted to 32×32 images, as in CIFAR papers.

    The 7×7 stride-2 stem and the max-pool would shrink a 32×32 image to 8×8 before the
    first block; a 3×3 stride-1 stem without the pool keeps 32×32, as in the CIFAR ResNets.
    """
    import torchvision

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def linear_classifier(num_classes: int = 10, image_shape=(3, 32, 32)) -> nn.Module:
    """Logistic regression on raw pixels: the baseline the shapes dataset must defeat."""
    channels, height, width = image_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, num_classes))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
