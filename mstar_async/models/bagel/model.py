"""``bagel``: a BAGEL-style unified model, text (and an input image) to an image.

Walks, for the default ``cfg="forked"`` mode:

- ``prefill``: the prompt into the paged KV cache, and the three guidance branches as forks of
  it: ``cond`` (the prompt), ``img_uncond`` (the same context: text-to-image has no input image)
  and ``text_uncond`` (forked before the prompt went in: an empty context).
- ``edit_prefill``: the input image through the ViT into the KV (``extend``), ``text_uncond``
  forked there (image only), the instruction after it (``cond``: image then text), and the
  instruction alone in a sequence of its own (``img_uncond``: text only).
- ``image_gen``: a ``Loop`` of rectified-flow Euler steps; each step runs the three branches in
  ``Parallel`` (one batched ``attend`` forward of the latent tokens over each branch's cached
  context), guides them and moves the latent; then the decoder makes RGB.

``cfg="dense"`` is the baseline: no KV cache; each branch recomputes its whole context with the
latent tokens at every step (``dense.py``). ``cfg="sequential"`` keeps the forked KV but runs the
branches one after another. All three modes use the same seeded weights, so they make the same
image.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mstar_async.engines import StatelessEngine
from mstar_async.engines.kv.cache import DEFAULT_BLOCK_SIZE, capacity_tokens
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.graph import (
    Block,
    ContextLimit,
    Edge,
    Loop,
    Model,
    Node,
    Parallel,
    Sequential,
    TokenCounter,
    Walk,
)
from mstar_async.models.bagel.config import BagelConfig, bagel_config, tokenize
from mstar_async.models.bagel.dense import dense_op
from mstar_async.models.bagel.flow import guide, timesteps
from mstar_async.models.bagel.mot import BagelLM
from mstar_async.models.bagel.vae import ImageDecoder
from mstar_async.models.bagel.vit import ImageEncoder
from mstar_async.models.registry import register
from mstar_async.outputs import ImageOutput

CFG_MODES = ("forked", "dense", "sequential")
BRANCHES = ("cond", "text_uncond", "img_uncond")
DEFAULT_KV_CACHE_BYTES = 64 * 2**20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEFAULT_PROMPT = "a red circle"


def build_lm_engine(
    cfg: BagelConfig, *, dtype: torch.dtype, kv_cache_bytes: int, device: str
) -> KVCacheEngine:
    """The backbone on a paged KV cache (prefill, fork, extend, attend)."""
    lm = BagelLM(cfg, dtype=dtype).to(device)
    return KVCacheEngine(
        lm,
        lm.language_model.attention_spec(dtype),
        num_layers=cfg.layers,
        kv_cache_bytes=kv_cache_bytes,
        device=device,
    )


def _dense_engine(cfg: BagelConfig, dtype: torch.dtype, device: str) -> StatelessEngine:
    lm = BagelLM(cfg, dtype=dtype).to(device)
    return StatelessEngine({"velocity": dense_op(lm)}, device=device)


def _vit_engine(cfg: BagelConfig, device: str) -> StatelessEngine:
    return StatelessEngine({"encode": ImageEncoder(cfg).to(device)}, device=device)


def _vae_engine(cfg: BagelConfig, device: str) -> StatelessEngine:
    return StatelessEngine({"decode": ImageDecoder(cfg).to(device)}, device=device)


def _flow_engine() -> StatelessEngine:
    return StatelessEngine({"guide": guide})


def load_image(image: Any, cfg: BagelConfig) -> torch.Tensor:
    """An input image as ``[3, S, S]`` in [0, 1] at the ViT's size: a ``[3, H, W]`` tensor in
    [0, 1] (resized when H or W differ from S), or a path to an image file (resized; needs
    Pillow). A server decodes images that arrive over the network into tensors: it never hands
    a path from a request to this function.

    Raises:
        ValueError: a tensor that is not ``[3, H, W]``, or a file Pillow cannot read.
    """
    size = cfg.vit_image_size
    if isinstance(image, torch.Tensor):
        if image.dim() != 3 or image.shape[0] != 3 or min(image.shape) < 1:
            raise ValueError(f"image must be [3, height, width] in [0, 1], got {image.shape}")
        if tuple(image.shape) == (3, size, size):
            return image.float()
        resized = F.interpolate(image.float()[None], size=(size, size), mode="bilinear")
        return resized[0].clamp(0, 1)
    from PIL import Image

    try:
        with Image.open(Path(image)) as img:
            rgb = img.convert("RGB").resize((size, size))
    except OSError as exc:
        raise ValueError(f"cannot read image {image!r}: {exc}") from exc
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return data.view(size, size, 3).permute(2, 0, 1).float() / 255


def _counter(cfg: BagelConfig) -> TokenCounter:
    def count(inputs: Mapping[str, Any]) -> int:
        # What the request's KV holds before the latents: the prompt, and for an edit the input
        # image's patches and the prompt again (the img_uncond branch holds it alone).
        prompt = len(tokenize(inputs.get("prompt", _DEFAULT_PROMPT)))
        if inputs.get("image") is None:
            return prompt
        return 2 * prompt + cfg.vit_grid**2

    return count


def _context_tokens(cfg: BagelConfig, mode: str, dtype: torch.dtype, kv_cache_bytes: int) -> int:
    # Every step attends the latents of three branches on scratch blocks beside the prompt (up
    # to two partial blocks each), and the latents take positions after the prompt.
    decoder = cfg.decoder()
    limit = decoder.max_position_embeddings - cfg.image_tokens
    if mode == "dense":
        return limit
    kv = capacity_tokens(
        decoder.attention_spec(dtype), num_layers=cfg.layers, kv_cache_bytes=kv_cache_bytes
    )
    return min(limit, kv - len(BRANCHES) * (cfg.image_tokens + 2 * DEFAULT_BLOCK_SIZE))


def _program(cfg: BagelConfig, mode: str) -> Callable[..., AsyncGenerator[Any, None]]:
    async def program(
        request: Any,
        prompt: str = _DEFAULT_PROMPT,
        image: Any = None,
        steps: int = 12,
        cfg_text_scale: float = 4.0,
        cfg_img_scale: Any = None,
        cfg_renorm_min: float = 0.0,
        timestep_shift: float = cfg.timestep_shift,
        seed: int = 0,
    ) -> AsyncGenerator[Any, None]:
        tokens = tokenize(prompt)
        pixels = None if image is None else load_image(image, cfg)
        img_scale = (1.0 if pixels is None else 2.0) if cfg_img_scale is None else cfg_img_scale
        gen = torch.Generator().manual_seed(seed)
        noise = torch.randn(cfg.image_tokens, cfg.token_dim, generator=gen)
        schedule = timesteps(steps, float(timestep_shift))
        inputs: dict[str, Any] = {
            "latent": noise,
            "t": schedule[0],
            "i": torch.tensor(0),
            "schedule": schedule,
            "cfg": torch.tensor([float(cfg_text_scale), float(img_scale), float(cfg_renorm_min)]),
        }
        if mode == "dense":
            inputs.update(await _dense_contexts(request, cfg, tokens, pixels))
        else:
            await _prefill(request, tokens, pixels)
            inputs.update({f"{b}.seq": b for b in BRANCHES})
        result = await request.run("image_gen", params={"steps": steps}, **inputs)
        yield ImageOutput(result["image"])

    return program


async def _prefill(request: Any, tokens: torch.Tensor, pixels: torch.Tensor | None) -> None:
    forks = {"fork_text.seq": "text_uncond", "fork_cond.seq": "cond"}
    if pixels is None:
        await request.run("prefill", tokens=tokens, **forks, **{"fork_img.seq": "img_uncond"})
    else:
        await request.run(
            "edit_prefill",
            pixels=pixels,
            tokens=tokens,
            **forks,
            **{"prefill_img_uncond.seq": "img_uncond"},
        )


async def _dense_contexts(
    request: Any, cfg: BagelConfig, tokens: torch.Tensor, pixels: torch.Tensor | None
) -> dict[str, Any]:
    no_image = torch.zeros(0, cfg.hidden)
    no_text = torch.zeros(0, dtype=torch.long)
    embeds = no_image
    if pixels is not None:
        embeds = (await request.run("encode_image", pixels=pixels))["embeds"]
    return {
        "cond.tokens": tokens,
        "cond.image": embeds,
        "text_uncond.tokens": no_text,
        "text_uncond.image": embeds,
        "img_uncond.tokens": tokens,
        "img_uncond.image": no_image,
    }


def _nodes(mode: str) -> list[Node]:
    common = [
        Node("vit", engine="vit", op="encode", inputs=["pixels"], outputs=["embeds"]),
        Node(
            "guide",
            engine="flow",
            inputs=["latent", "cond_v", "text_v", "img_v", "i", "schedule", "cfg"],
            outputs=["latent", "i", "t"],
        ),
        Node("vae", engine="vae", op="decode", inputs=["latent"], outputs=["image"]),
    ]
    if mode == "dense":
        branch_inputs = ["tokens", "image", "latent", "t"]
        return [
            *common,
            *(
                Node(b, engine="dense", op="velocity", inputs=branch_inputs, outputs=["velocity"])
                for b in BRANCHES
            ),
        ]

    def fork(name: str) -> Node:
        return Node(name, engine="lm", op="fork", inputs=["seq"], outputs=["seq"])

    return [
        *common,
        fork("fork_text"),
        fork("fork_cond"),
        fork("fork_img"),
        Node("prefill", engine="lm", inputs=["tokens"], outputs=["token"]),
        Node(
            "prefill_img_uncond",
            engine="lm",
            op="prefill",
            inputs=["tokens", "seq"],
            outputs=["token"],
        ),
        Node("extend_image", engine="lm", op="extend", inputs=["embeds"], outputs=["length"]),
        *(
            Node(b, engine="lm", op="attend", inputs=["seq", "latent", "t"], outputs=["velocity"])
            for b in BRANCHES
        ),
    ]


def _walks(mode: str) -> list[Walk]:
    branches: Block = Sequential(*BRANCHES) if mode == "sequential" else Parallel(*BRANCHES)
    denoise = Loop(
        Sequential(branches, "guide"),
        iterations="steps",
        carry={
            "guide.latent": [*(f"{b}.latent" for b in BRANCHES), "guide.latent"],
            "guide.t": [f"{b}.t" for b in BRANCHES],
            "guide.i": "guide.i",
        },
    )
    gen = Walk("image_gen", Sequential(denoise, "vae"), outputs=["vae.image"])
    if mode == "dense":
        return [Walk("encode_image", "vit", outputs=["vit.embeds"]), gen]
    return [
        Walk(
            "prefill",
            Sequential("fork_text", "prefill", Parallel("fork_cond", "fork_img")),
            outputs=["prefill.token"],
        ),
        Walk(
            "edit_prefill",
            Sequential(
                "vit",
                "extend_image",
                "fork_text",
                Parallel("prefill", "prefill_img_uncond"),
                "fork_cond",
            ),
            outputs=["prefill.token"],
        ),
        gen,
    ]


def _edges(mode: str) -> list[Edge]:
    edges = [
        Edge("cond.velocity", "guide.cond_v"),
        Edge("text_uncond.velocity", "guide.text_v"),
        Edge("img_uncond.velocity", "guide.img_v"),
        Edge("guide.latent", "vae.latent"),
    ]
    if mode != "dense":
        edges.append(Edge("vit.embeds", "extend_image.embeds"))
    return edges


@register("bagel", "BAGEL-style text+image model: KV prefill, forked-KV CFG flow loop, VAE decode")
def build_bagel(
    size: str = "tiny",
    *,
    cfg: str = "forked",
    dtype: str = "float32",
    device: str = "cpu",
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    **overrides: Any,
) -> Model:
    """Build the model at ``size`` (``tiny`` or ``small``) with seeded weights.

    ``cfg`` picks how guidance branches run: ``forked`` (forks of the prompt's paged KV, batched
    in one forward), ``dense`` (each branch recomputes its whole context every step, batched)
    or ``sequential`` (forked KV, one branch after another). ``overrides`` set ``BagelConfig``
    fields. A request's prompt (and input image) may not pass what the backbone's positions
    and KV cache hold beside the latents (``model.context``); ``info["image_inputs"]`` names
    the input that takes an image.

    Raises:
        ValueError: an unknown size, cfg mode or dtype; ``kv_cache_bytes`` fits no KV block.
        TypeError: an override names no ``BagelConfig`` field.
    """
    if cfg not in CFG_MODES:
        raise ValueError(f"cfg must be one of {CFG_MODES}, got {cfg!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    config = bagel_config(size, **overrides)
    torch_dtype = _DTYPES[dtype]
    components: dict[str, Callable[[], Any]] = {
        "vit": functools.partial(_vit_engine, config, device),
        "vae": functools.partial(_vae_engine, config, device),
        "flow": _flow_engine,
    }
    if cfg == "dense":
        components["dense"] = functools.partial(_dense_engine, config, torch_dtype, device)
    else:
        components["lm"] = functools.partial(
            build_lm_engine,
            config,
            dtype=torch_dtype,
            kv_cache_bytes=kv_cache_bytes,
            device=device,
        )
    return Model(
        "bagel",
        nodes=_nodes(cfg),
        edges=_edges(cfg),
        walks=_walks(cfg),
        program=_program(config, cfg),
        components=components,
        description=f"BAGEL-style {size} model, {cfg} CFG branches",
        info={"image_size": config.image_size, "image_inputs": ["image"]},
        context=ContextLimit(
            _context_tokens(config, cfg, torch_dtype, kv_cache_bytes),
            _counter(config),
            generates=None,
            token_chars=1,  # a byte a token
        ),
    )
