"""Writing a model's image outputs to files (``mstar run MODEL -o out.png``)."""

from __future__ import annotations

from pathlib import Path

import torch

from mstar_async.errors import MstarError
from mstar_async.outputs import ImageOutput


def save_png(image: torch.Tensor, path: Path) -> None:
    """Write a ``[3, H, W]`` (or ``[1, H, W]``) float image in [0, 1] as a PNG (needs Pillow).

    Raises:
        MstarError: Pillow is not installed, the tensor is not an image, or the file cannot be
            written.
    """
    try:
        from PIL import Image
    except ImportError:
        raise MstarError(
            "writing PNG files needs Pillow: pip install 'mstar-async[image]'"
        ) from None
    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise MstarError(f"an image output must be [3 or 1, H, W], got {tuple(image.shape)}")
    pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    hwc = pixels.permute(1, 2, 0).contiguous()
    mode = "RGB" if image.shape[0] == 3 else "L"
    array = hwc.numpy() if mode == "RGB" else hwc[..., 0].numpy()
    try:
        Image.fromarray(array, mode=mode).save(path, format="PNG")
    except OSError as exc:
        raise MstarError(f"cannot write {path}: {exc}") from exc


def write_images(path: Path, images: list[ImageOutput]) -> str:
    """Write each image to ``path`` (the second to ``stem-1.png``, and so on); return a line
    naming the files written.

    Raises:
        MstarError: there is no image, or as ``save_png``.
    """
    if not images:
        raise MstarError(f"the request produced no image to save in {path}")
    written = []
    for k, item in enumerate(images):
        target = path if k == 0 else path.with_stem(f"{path.stem}-{k}")
        save_png(item.image, target)
        written.append(str(target))
    return f"wrote {', '.join(written)}"
