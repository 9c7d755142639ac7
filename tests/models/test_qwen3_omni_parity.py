"""qwen3-omni parts against transformers' ``qwen3_omni_moe`` modules on tiny random configs.

Upstream modules are built from tiny configs with random weights; their state dicts load into
ours by upstream names (strictly), and both run the same inputs in float32.
"""

from __future__ import annotations

import functools
import inspect
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from mstar_async.engines.base import Step
from mstar_async.graph import StreamEnd
from mstar_async.models import build_model
from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
from mstar_async.models.checkpoints.streaming import StateDictSource, empty_module
from mstar_async.models.qwen3_omni.audio_prompt import build_prompt
from mstar_async.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
from mstar_async.models.qwen3_omni.decoder import DenseCausalAttention, Qwen3Config, seeded_init
from mstar_async.models.qwen3_omni.model import talker_tokens
from mstar_async.models.qwen3_omni.talker import (
    REPETITION_PENALTY,
    Talker,
    TalkerTokens,
    talker_prompt,
    text_row,
)
from mstar_async.models.qwen3_omni.thinker import Thinker
from mstar_async.models.qwen3_omni.weights import OmniWeights, load_upstream
from mstar_async.outputs import AudioChunk, LatentOutput, TextDelta
from mstar_async.policies import LeftContextChunkPolicy
from mstar_async.runtime import open_runtime

hf = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
hf_config = pytest.importorskip("transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe")

pytestmark = pytest.mark.timeout(60)

TOL = {"atol": 1e-4, "rtol": 1e-4}

TEXT = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = 0.5 if param.dim() > 1 else 0.1
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
            if name.endswith("norm.weight"):
                param.add_(1.0)


def test_thinker_text_model_logits_match_upstream() -> None:
    upstream = hf.Qwen3OmniMoeThinkerTextModel(hf_config.Qwen3OmniMoeTextConfig(**TEXT)).eval()
    _randomise(upstream, 0)
    cfg = Qwen3Config.from_hf(TEXT)
    assert cfg.sparse(0) and cfg.sparse(1)
    ours = empty_module(lambda: Thinker(cfg, TEXT["vocab_size"]))
    head = torch.randn(
        TEXT["vocab_size"], TEXT["hidden_size"], generator=torch.Generator().manual_seed(1)
    )
    state = {f"model.{k}": v for k, v in upstream.state_dict().items()} | {"lm_head.weight": head}
    load_upstream(ours, StateDictSource(state), "")
    ids = torch.randint(0, TEXT["vocab_size"], (11,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = upstream(input_ids=ids[None]).last_hidden_state[0] @ head.T
        got = ours.compute_logits(ours(ids, DenseCausalAttention(len(ids))))
    torch.testing.assert_close(got, want, **TOL)


def _talker_config() -> Any:
    text = {**TEXT, "shared_expert_intermediate_size": 24, "norm_topk_prob": False}
    predictor = {
        key: TEXT[key]
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    } | {
        "vocab_size": 40,
        "num_hidden_layers": 1,
        "num_code_groups": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    return hf_config.Qwen3OmniMoeTalkerConfig(
        text_config=text,
        code_predictor_config=predictor,
        num_code_groups=4,
        thinker_hidden_size=48,
        spatial_merge_size=2,
    )


def _talkers() -> tuple[Any, Talker]:
    upstream = hf.Qwen3OmniMoeTalkerForConditionalGeneration(_talker_config()).eval()
    _randomise(upstream, 3)
    cfg = Qwen3Config.from_hf(TEXT)
    ours = empty_module(
        lambda: Talker(
            replace(cfg, shared_expert_intermediate_size=24, norm_topk_prob=False),
            vocab=TEXT["vocab_size"],
            thinker_hidden=48,
            predictor=replace(cfg, num_hidden_layers=1, num_experts=0),
            codebook_size=40,
            groups=4,
        )
    )
    load_upstream(ours, StateDictSource(upstream.state_dict()), "")
    return upstream, ours


def test_talker_hidden_codec_logits_and_projection_match_upstream() -> None:
    upstream, ours = _talkers()
    gen = torch.Generator().manual_seed(4)
    thinker_rows = torch.randn(9, 48, generator=gen)
    with torch.no_grad():
        rows = upstream.text_projection(thinker_rows)
        torch.testing.assert_close(ours.text_projection(thinker_rows), rows, **TOL)
        want = upstream.codec_head(upstream.model(inputs_embeds=rows[None]).last_hidden_state[0])
        got = ours.codec_head(ours.model(rows, DenseCausalAttention(9)))
    torch.testing.assert_close(got, want, **TOL)


def test_code_predictor_matches_upstream_per_group() -> None:
    upstream, ours = _talkers()
    gen = torch.Generator().manual_seed(5)
    context = torch.randn(2, 32, generator=gen)
    codes = [7, 19]
    with torch.no_grad():
        cp = upstream.code_predictor
        rows = torch.cat(
            [context]
            + [cp.model.codec_embedding[g](torch.tensor([c])) for g, c in enumerate(codes)]
        )
        want_hidden = cp.model(inputs_embeds=rows[None]).last_hidden_state[0]
        ours_rows = torch.cat(
            [context] + [ours.code_predictor.embed(g + 1, c)[None] for g, c in enumerate(codes)]
        )
        got_hidden = ours.code_predictor.model(ours_rows, DenseCausalAttention(4))
        torch.testing.assert_close(got_hidden, want_hidden, **TOL)
        for group in range(3):
            torch.testing.assert_close(
                ours.code_predictor.lm_head[group](got_hidden[group + 1]),
                cp.lm_head[group](want_hidden[group + 1]),
                **TOL,
            )


def test_code2wav_matches_upstream_beyond_its_sliding_window() -> None:
    fields = {
        "codebook_size": 32,
        "num_quantizers": 4,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "sliding_window": 6,
        "upsample_rates": [4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 16,
    }
    upstream = hf.Qwen3OmniMoeCode2Wav(hf_config.Qwen3OmniMoeCode2WavConfig(**fields)).eval()
    seeded_init(upstream, 6)
    ours = empty_module(lambda: Code2Wav(Code2WavConfig.from_hf(fields)))
    load_upstream(ours, StateDictSource(upstream.state_dict()), "")
    codes = torch.randint(0, 32, (4, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = upstream(codes[None]).reshape(-1)
        got = ours(codes)
    assert got.shape == want.shape
    assert (want.abs() < 1).float().mean() > 0.1, "the test signal is all clipped"
    torch.testing.assert_close(got, want, **TOL)
    with torch.no_grad():
        chunked = upstream.chunked_decode(codes[None], chunk_size=8, left_context_size=5).reshape(
            -1
        )
    from mstar_async.models.qwen3_omni.code2wav import chunked_decode

    torch.testing.assert_close(chunked_decode(ours, codes.T, 8, 5), chunked, **TOL)


def _released(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """``state`` in the released files' layout: one matrix per expert and projection."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        stack = key.removesuffix("gate_up_proj").removesuffix("down_proj")
        if not stack.endswith("experts."):
            out[prefix + key] = value
            continue
        for e in range(value.shape[0]):
            if key.endswith("down_proj"):
                out[f"{prefix}{stack}{e}.down_proj.weight"] = value[e].clone()
            else:
                gate, up = value[e].chunk(2)
                out[f"{prefix}{stack}{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}{stack}{e}.up_proj.weight"] = up.clone()
    return out


def test_released_expert_layout_and_language_model_prefix_load_into_the_fused_stacks() -> None:
    upstream = hf.Qwen3OmniMoeThinkerTextModel(hf_config.Qwen3OmniMoeTextConfig(**TEXT)).eval()
    _randomise(upstream, 9)
    state = _released(upstream.state_dict(), "thinker.model.language_model.")
    assert "thinker.model.language_model.layers.1.mlp.experts.3.up_proj.weight" in state
    state["thinker.lm_head.weight"] = torch.randn(TEXT["vocab_size"], TEXT["hidden_size"])
    state["thinker.audio_tower.proj.weight"] = torch.zeros(4, 4)  # a tower: never read
    ours = empty_module(lambda: Thinker(Qwen3Config.from_hf(TEXT), TEXT["vocab_size"]))
    stats = load_upstream(
        ours, StateDictSource(state), "thinker.", claims=("thinker.model.", "thinker.lm_head.")
    )
    assert sorted(stats.names) == sorted(set(state) - {"thinker.audio_tower.proj.weight"})
    ours_state, want = ours.state_dict(), upstream.state_dict()
    for layer in range(2):
        for stack in ("gate_up_proj", "down_proj"):
            key = f"layers.{layer}.mlp.experts.{stack}"
            assert torch.equal(ours_state[f"model.{key}"], want[key]), key
    assert torch.equal(ours.lm_head.weight, state["thinker.lm_head.weight"])


def test_loading_names_what_is_missing_and_changes_nothing() -> None:
    ours = empty_module(lambda: Thinker(Qwen3Config.from_hf(TEXT), TEXT["vocab_size"]))
    source = StateDictSource({"thinker.lm_head.weight": torch.zeros(96, 32)})
    with pytest.raises(ValueError, match=r"missing keys \['thinker.model.embed_tokens.weight'"):
        load_upstream(ours, source, "thinker.")
    assert all(param.is_meta for param in ours.parameters())


# ------------------------------------------------------------------ a whole checkpoint folder

VOCAB = 49152 + 3  # the SmolLM2 tokenizer's vocabulary and three tts ids


def _omni_config() -> Any:
    text = {**TEXT, "vocab_size": VOCAB}
    # Upstream's generate suppresses the talker's last 1024 ids but end of speech: the codec
    # specials above a codebook of 64, as in the released layout (2048 + 1024).
    talker_text = {
        **TEXT,
        "vocab_size": 64 + 1024,
        "shared_expert_intermediate_size": 24,
        "norm_topk_prob": False,
    }
    predictor = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_code_groups": 4,
    }
    audio = {
        "num_mel_bins": 16,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 32,
        "d_model": 16,
        "output_dim": 32,
        "downsample_hidden_size": 8,
    }
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "deepstack_visual_indexes": [0],
        "num_position_embeddings": 16,
    }
    names = ["codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id"]
    names += ["codec_think_bos_id", "codec_think_eos_id"]
    codec = {name: 64 + i for i, name in enumerate(names)}
    return hf_config.Qwen3OmniMoeConfig(
        thinker_config={"text_config": text, "audio_config": audio, "vision_config": vision},
        talker_config={
            "text_config": talker_text,
            "code_predictor_config": predictor,
            "num_code_groups": 4,
            "thinker_hidden_size": 32,
            "speaker_id": {"ethan": 70},  # lower case, as released
            "spatial_merge_size": 2,
            **codec,
        },
        code2wav_config={
            "codebook_size": 64,
            "num_quantizers": 4,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "decoder_dim": 16,
        },
        tts_bos_token_id=VOCAB - 3,
        tts_eos_token_id=VOCAB - 2,
        tts_pad_token_id=VOCAB - 1,
    )


@pytest.fixture(scope="module")
def omni_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A tiny random ``Qwen3OmniMoeForConditionalGeneration`` saved as a checkpoint folder
    (transformers writes the released layout: per-expert keys, ``thinker.model.*``), with the
    SmolLM2 tokenizer beside it."""
    torch.manual_seed(0)
    upstream = hf.Qwen3OmniMoeForConditionalGeneration(_omni_config()).eval()
    seeded_init(upstream, 8)
    folder = tmp_path_factory.mktemp("qwen3-omni")
    upstream.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder() / name, folder / name)
    return upstream, folder


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_checkpoint_folder_text_and_audio_match_upstream(
    omni_folder: tuple[Any, Path],
) -> None:
    upstream, folder = omni_folder
    chunk = 4
    model = build_model("qwen3-omni", path=folder, chunk=chunk, left_context=chunk)
    async with open_runtime(model) as runtime:
        with anyio.fail_after(60):
            async with runtime.generate(
                text="Hi there", max_tokens=12, max_frames=19, ignore_eos=True, return_codes=True
            ) as outputs:
                items = [item async for item in outputs]
    tokenizer = ChatTokenizer.from_folder(folder)
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}]))
    language_model, head = upstream.thinker.model.language_model, upstream.thinker.lm_head
    with torch.no_grad():
        for _ in range(12):
            hidden = language_model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
            ids.append(int(head(hidden).argmax()))
    text = "".join(o.text for o in items if isinstance(o, TextDelta))
    assert text == tokenizer.decode(ids[-12:])
    frames = torch.stack([o.latent for o in items if isinstance(o, LatentOutput)])
    pcm = torch.cat([o.pcm for o in items if isinstance(o, AudioChunk)])
    # 11 frames with the text, the rest after it: one walk, one grid of windows across both.
    assert frames.shape[0] > 11
    with torch.no_grad():
        want = upstream.code2wav.chunked_decode(
            frames.T[None], chunk_size=chunk, left_context_size=chunk
        )
    # Six upsampling stages (1920x) of float32 convolutions: a few samples differ by ~5e-4.
    torch.testing.assert_close(pcm, want.reshape(-1), atol=2e-3, rtol=1e-3)


class _TalkerCalled(Exception):
    """Upstream's generate got as far as calling its talker."""


def _one_piece_header(ids: list[int], tokens: TalkerTokens) -> list[int]:
    """A prompt ending in the assistant header, as upstream reads it. Upstream takes the
    header to be three tokens, as Qwen's tokenizer makes it; SmolLM2's splits "assistant" in
    two: keep its first piece."""
    assert ids[-3] == tokens.assistant
    return [*ids[:-2], ids[-1]]


def _upstream_for_smollm2(
    upstream: Any, tokens: TalkerTokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Point upstream's generate at SmolLM2's chat ids (its defaults are Qwen's), and let it
    run on the tiny thinker."""
    roles = {"im_start": tokens.im_start, "user": tokens.user, "assistant": tokens.assistant}
    for name, value in roles.items():
        monkeypatch.setattr(upstream.config, f"{name}_token_id", value)
    # transformers 5.24's thinker generate reads an id its config lacks (unused without video),
    # and its hidden state after accept_hidden_layer layers (used at audio positions only; the
    # default, 18, is past the tiny thinker's 2).
    vision_start = upstream.config.talker_config.vision_start_token_id
    monkeypatch.setattr(
        upstream.thinker.config, "vision_start_token_id", vision_start, raising=False
    )
    monkeypatch.setattr(upstream.config.talker_config, "accept_hidden_layer", 1)


def _parts_of(model: Any, tokenizer: ChatTokenizer) -> tuple[OmniWeights, TalkerTokens]:
    factory = model.components["talker"]
    assert isinstance(factory, functools.partial)
    weights: OmniWeights = factory.args[0]  # the model's parts
    return weights, talker_tokens(weights.config, tokenizer)


def test_the_talker_is_fed_upstreams_inputs_from_the_thinker_engines_rows(
    omni_folder: tuple[Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream, folder = omni_folder
    tokenizer = ChatTokenizer.from_folder(folder)
    model = build_model("qwen3-omni", path=folder)
    weights, tokens = _parts_of(model, tokenizer)
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}]))
    ids = _one_piece_header(ids, tokens)
    new = 6
    # Ours: what the thinker's engine hands the talker, greedy, as the walks carry it.
    thinker = model.components["thinker"]()
    made = thinker.forward([Step("r", "prefill", {"tokens": torch.tensor(ids)})])
    for _ in range(new - 1):
        made += thinker.forward([Step("r", "decode", {"token": made[-1]["token"]})])
    prefill = made[0]
    assert prefill["rows"].shape[0] < len(ids)  # the system turn's rows stay on its rank
    policy = LeftContextChunkPolicy(1, 0, lookahead=1)
    chunks = [c for out in made[1:] for c in policy.push(out["row"][None])] + policy.close()
    # Upstream's: the inputs its generate gives the talker, from the thinker's hidden states.
    _upstream_for_smollm2(upstream, tokens, monkeypatch)
    fed: dict[str, Any] = {}

    def talker_generate(**kwargs: Any) -> None:
        fed.update(kwargs)
        raise _TalkerCalled

    monkeypatch.setattr(upstream.talker, "generate", talker_generate)
    with torch.no_grad(), pytest.raises(_TalkerCalled):
        upstream.generate(
            input_ids=torch.tensor([ids]),
            speaker="ethan",
            thinker_max_new_tokens=new,
            thinker_do_sample=False,
        )
    talker = weights.talker()
    speaker = tokens.speakers["ethan"]
    with torch.no_grad():
        prompt = talker_prompt(
            talker,
            tokens,
            torch.tensor(ids),
            prefill["rows"],
            prefill["row"],
            prefill["tts"],
            speaker,
        )
        trailing = torch.stack([text_row(talker, prefill["tts"], chunk) for chunk in chunks])
        pad = text_row(talker, prefill["tts"], StreamEnd())
    torch.testing.assert_close(prompt, fed["inputs_embeds"][0], atol=1e-5, rtol=1e-5)
    # One text row per frame: tokens 2 .. new - 1, then tts_eos in place of the last; then pad.
    assert trailing.shape[0] == new - 1
    torch.testing.assert_close(trailing, fed["trailing_text_hidden"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pad, fed["tts_pad_embed"][0, 0], atol=1e-5, rtol=1e-5)


def _upstream_frames(
    upstream: Any,
    ids: list[int],
    new: int,
    frames: int,
    monkeypatch: pytest.MonkeyPatch,
    **options: Any,
) -> list[list[int]]:
    """The frames of upstream's own ``generate``, greedy (``talker_do_sample=False``, which it
    mirrors onto its code predictor) and otherwise at its defaults but ``options``: codebook 0
    from its talker's sequence, the residual codes its code predictor made for each."""
    made: dict[str, Any] = {}
    talker_generate = upstream.talker.generate

    def keep(**kwargs: Any) -> Any:
        made["result"] = talker_generate(**kwargs)
        return made["result"]

    monkeypatch.setattr(upstream.talker, "generate", keep)
    with torch.no_grad():
        upstream.generate(
            input_ids=torch.tensor([ids]),
            speaker="ethan",
            thinker_max_new_tokens=new,
            thinker_do_sample=False,
            talker_do_sample=False,
            # The last code it samples gets no residual codes: one frame fewer than codes.
            talker_max_new_tokens=frames + 1,
            **options,
        )
    hidden = made["result"].hidden_states
    codes = torch.stack([h[-1] for h in hidden if h[-1] is not None], dim=1)[0]
    return codes.tolist()


# transformers says what its talker's penalty reads: the codes it generated, not its prompt.
@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`")
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_talker_frames_match_upstreams_generate_with_its_repetition_penalty(
    omni_folder: tuple[Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream, folder = omni_folder
    tokenizer = ChatTokenizer.from_folder(folder)
    model = build_model("qwen3-omni", path=folder)
    # Our default is upstream's.
    ours_default = inspect.signature(model.program).parameters["repetition_penalty"].default
    theirs_default = inspect.signature(upstream.generate).parameters["talker_repetition_penalty"]
    assert ours_default == theirs_default.default == REPETITION_PENALTY
    _, tokens = _parts_of(model, tokenizer)
    _upstream_for_smollm2(upstream, tokens, monkeypatch)

    # Our program renders the chat itself: give it upstream's header too.
    def one_piece(*args: Any, **kwargs: Any) -> Any:
        prompt = build_prompt(*args, **kwargs)
        return replace(prompt, ids=_one_piece_header(prompt.ids, tokens))

    monkeypatch.setattr("mstar_async.models.qwen3_omni.model.build_prompt", one_piece)
    messages = [{"role": "user", "content": "Hi there"}]
    ids = _one_piece_header(tokenizer.encode(tokenizer.apply_chat_template(messages)), tokens)
    new, frames = 6, 16
    # Upstream's default (passed to neither), none, and a strong one.
    ours: dict[float | None, list[list[int]]] = {}
    async with open_runtime(model) as runtime:
        for penalty in (None, 1.0, 3.0):
            given: dict[str, Any] = {} if penalty is None else {"repetition_penalty": penalty}
            with anyio.fail_after(60):
                async with runtime.generate(
                    text="Hi there",
                    max_tokens=new,
                    max_frames=frames,
                    ignore_eos=True,  # upstream's thinker stops on Qwen's id, not in this vocab
                    temperature=0,
                    voice_temperature=0,
                    return_codes=True,
                    **given,
                ) as outputs:
                    items = [item async for item in outputs]
            ours[penalty] = [o.latent.tolist() for o in items if isinstance(o, LatentOutput)]
    # The penalty changes what is said, even at upstream's default, so each comparison below
    # checks it, not a no-op; the strong one ends the speech early, at end of speech.
    assert ours[None] != ours[1.0] != ours[3.0]
    assert len(ours[None]) == len(ours[1.0]) == frames > len(ours[3.0])
    for penalty, frames_made in ours.items():
        options = {} if penalty is None else {"talker_repetition_penalty": penalty}
        theirs = _upstream_frames(upstream, ids, new, frames, monkeypatch, **options)
        assert frames_made == theirs, penalty
