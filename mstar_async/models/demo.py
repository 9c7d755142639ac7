"""``demo``: a tiny composite model that exercises every primitive with real torch computation.

A GRU language model emits audio codes in a ``DynamicLoop`` (until end-of-speech or a per-request
limit); the codes stream over a ``SlidingWindowChunkPolicy`` edge into a convolutional codec that
turns each window into PCM while the loop is still running. Then a ``Loop`` of guided denoising
steps runs conditional and unconditional branches in ``Parallel`` (they batch into one forward)
on the LM's prompt state, and a linear decoder turns the final latent into a small image.
The weights are seeded random: the point is the data path, not the content.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar_async.engines import StatelessEngine
from mstar_async.graph import (
    DynamicLoop,
    Edge,
    Loop,
    LoopStep,
    Model,
    Node,
    Parallel,
    Sequential,
    Walk,
    stream,
)
from mstar_async.models.registry import register
from mstar_async.outputs import AudioChunk, ImageOutput
from mstar_async.policies import Chunk, SlidingWindowChunkPolicy


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo model. A code is ``hop`` samples: 20 ms at 16 kHz."""

    vocab: int = 64
    hidden: int = 64
    hop: int = 320
    sample_rate: int = 16_000
    window: int = 8
    stride: int = 4
    latent: int = 48
    image_size: int = 16
    seed: int = 0

    @property
    def end_of_speech(self) -> int:
        return self.vocab - 1


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build().eval()


class TinyLM(nn.Module):
    """A GRU language model over a shared text/code vocabulary, greedy decoding."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.cell = nn.GRUCell(cfg.hidden, cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab)

    def prefill(self, tokens: torch.Tensor | list[torch.Tensor]) -> dict[str, torch.Tensor]:
        states = []
        for seq in tokens:
            h = torch.zeros(1, self.cell.hidden_size)
            for emb in self.embed(seq).unsqueeze(1):
                h = self.cell(emb, h)
            states.append(h[0])
        h = torch.stack(states)
        return {"h": h, "code": self.head(h).argmax(-1)}

    def step(self, code: torch.Tensor, h: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.cell(self.embed(code), h)
        return {"h": h, "code": self.head(h).argmax(-1)}


class TinyCodec(nn.Module):
    """Codes to PCM: embedding, a 3-tap convolution (so a window's context matters), projection."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, 32)
        self.conv = nn.Conv1d(32, 32, kernel_size=3, padding=1)
        self.proj = nn.Linear(32, cfg.hop)

    def decode_window(self, codes: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.embed(codes).transpose(-1, -2)).transpose(-1, -2)
        return (0.5 * torch.tanh(self.proj(torch.nn.functional.gelu(x)))).flatten(-2)

    def forward(self, codes: list[Chunk]) -> dict[str, list[torch.Tensor]]:
        """One PCM tensor per chunk: the audio of its new codes (none for a final chunk that
        brings no new code), decoded with the whole window as context."""
        hop = self.proj.out_features
        pcm = []
        for chunk in codes:
            if not len(chunk.new):
                pcm.append(torch.zeros(0))
                continue
            assert isinstance(chunk.data, torch.Tensor)
            stop = len(chunk.data) - chunk.lookahead
            pcm.append(self.decode_window(chunk.data)[chunk.context * hop : stop * hop])
        return {"pcm": pcm}


class TinyDenoiser(nn.Module):
    """Predicts the noise in a latent given a text state (zeros for the unconditional branch)."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.text = nn.Linear(cfg.hidden, cfg.latent)
        self.mlp = nn.Sequential(
            nn.Linear(2 * cfg.latent, 128), nn.GELU(), nn.Linear(128, cfg.latent)
        )

    def forward(self, latent: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"eps": self.mlp(torch.cat([latent, self.text(text)], dim=-1))}


def guide(
    latent: torch.Tensor, cond_eps: torch.Tensor, uncond_eps: torch.Tensor, scale: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One classifier-free-guided update of the latent."""
    eps = uncond_eps + scale.unsqueeze(-1) * (cond_eps - uncond_eps)
    return {"latent": latent - 0.1 * eps}


class TinyImageDecoder(nn.Module):
    """Latent to an RGB image in [0, 1]."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.size = cfg.image_size
        self.proj = nn.Linear(cfg.latent, 3 * cfg.image_size**2)

    def forward(self, latent: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"image": torch.sigmoid(self.proj(latent)).view(-1, 3, self.size, self.size)}


def _lm_engine(cfg: DemoConfig) -> StatelessEngine:
    lm = _seeded(cfg.seed, lambda: TinyLM(cfg))
    assert isinstance(lm, TinyLM)
    return StatelessEngine({"prefill": lm.prefill, "step": lm.step})


def _codec_engine(cfg: DemoConfig) -> StatelessEngine:
    return StatelessEngine({"decode": _seeded(cfg.seed + 1, lambda: TinyCodec(cfg))})


def _denoiser_engine(cfg: DemoConfig) -> StatelessEngine:
    return StatelessEngine({"eps": _seeded(cfg.seed + 2, lambda: TinyDenoiser(cfg))})


def _vae_engine(cfg: DemoConfig) -> StatelessEngine:
    return StatelessEngine({"decode": _seeded(cfg.seed + 3, lambda: TinyImageDecoder(cfg))})


def _cfg_engine() -> StatelessEngine:
    return StatelessEngine({"guide": guide})


def tokenize(text: str, cfg: DemoConfig) -> torch.Tensor:
    """Bytes of the text folded into the vocabulary (end-of-speech excluded)."""
    return torch.tensor([b % (cfg.vocab - 1) for b in text.encode()] or [0], dtype=torch.long)


def _speech_done(cfg: DemoConfig) -> Callable[[LoopStep], bool]:
    def until(step: LoopStep) -> bool:
        code = int(step.outputs["step.code"])
        return code == cfg.end_of_speech or step.iteration + 1 >= int(step.params["max_codes"])

    return until


def _program(cfg: DemoConfig) -> Callable[..., AsyncGenerator[Any, None]]:
    async def program(
        request: Any,
        text: str = "Hello from mstar_async.",
        max_codes: int = 48,
        steps: int = 8,
        guidance: float = 3.0,
        seed: int = 0,
        image: bool = True,
    ) -> AsyncGenerator[Any, None]:
        # image=False makes the request speech only (a text-to-speech session's segments).
        await request.run("prefill", tokens=tokenize(text, cfg))
        async with request.stream("speak", params={"max_codes": max_codes}) as speech:
            async for event in speech:
                if event.value.numel():
                    yield AudioChunk(event.value, cfg.sample_rate)
        if not image:
            return
        noise = torch.randn(cfg.latent, generator=torch.Generator().manual_seed(seed))
        result = await request.run(
            "image",
            params={"steps": steps},
            latent=noise,
            scale=torch.tensor(float(guidance)),
            **{"uncond.text": torch.zeros(cfg.hidden)},
        )
        yield ImageOutput(result["image"])

    return program


@register("demo", "tiny GRU speech LM -> streaming codec, then a CFG denoising loop -> image")
def build_demo(**overrides: Any) -> Model:
    """Build the demo model; ``overrides`` set ``DemoConfig`` fields (e.g. ``seed=1``).

    Raises:
        TypeError: an override names no ``DemoConfig`` field.
    """
    cfg = DemoConfig(**overrides)
    nodes = [
        Node("prefill", engine="lm", op="prefill", inputs=["tokens"], outputs=["h", "code"]),
        Node("step", engine="lm", op="step", inputs=["code", "h"], outputs=["code", "h"]),
        Node("codec", engine="codec", op="decode", inputs=["codes"], outputs=["pcm"]),
        Node("cond", engine="denoiser", op="eps", inputs=["latent", "text"], outputs=["eps"]),
        Node("uncond", engine="denoiser", op="eps", inputs=["latent", "text"], outputs=["eps"]),
        Node(
            "guide",
            engine="cfg",
            inputs=["latent", "cond_eps", "uncond_eps", "scale"],
            outputs=["latent"],
        ),
        Node("vae", engine="vae", op="decode", inputs=["latent"], outputs=["image"]),
    ]
    edges = [
        Edge("prefill.h", "step.h"),
        Edge("prefill.code", "step.code"),
        Edge("prefill.h", "cond.text"),
        stream("step.code", "codec.codes", SlidingWindowChunkPolicy(cfg.window, cfg.stride)),
        Edge("cond.eps", "guide.cond_eps"),
        Edge("uncond.eps", "guide.uncond_eps"),
        Edge("guide.latent", "vae.latent"),
    ]
    speak = DynamicLoop(
        "step",
        until=_speech_done(cfg),
        max_iterations=4096,
        carry={"step.code": "step.code", "step.h": "step.h"},
    )
    denoise = Loop(
        Sequential(Parallel("cond", "uncond"), "guide"),
        iterations="steps",
        carry={"guide.latent": ["cond.latent", "uncond.latent", "guide.latent"]},
    )
    return Model(
        "demo",
        nodes=nodes,
        edges=edges,
        walks=[
            Walk("prefill", "prefill"),
            Walk("speak", Sequential(speak, "codec"), outputs=["codec.pcm"]),
            Walk("image", Sequential(denoise, "vae")),
        ],
        program=_program(cfg),
        components={
            "lm": functools.partial(_lm_engine, cfg),
            "codec": functools.partial(_codec_engine, cfg),
            "denoiser": functools.partial(_denoiser_engine, cfg),
            "cfg": _cfg_engine,
            "vae": functools.partial(_vae_engine, cfg),
        },
        description="tiny composite: streaming speech, then guided image denoising",
    )
