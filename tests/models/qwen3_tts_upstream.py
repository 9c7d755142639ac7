"""Import the ``qwen-tts`` package's model modules against the installed transformers.

``qwen-tts`` 0.1.1 pins transformers 4.57.3 (and librosa, torchaudio, gradio, ...), so it is
installed with ``--no-deps`` (``.ci/run`` does). Its model modules then need four small
adjustments to import and run under transformers 5, made here and only here, none of which
touches the computation compared:

- the package ``__init__`` imports its inference helpers (librosa, soundfile): the model
  modules are imported without it;
- ``librosa.filters.mel`` (the speaker encoder's filter bank) is provided by transformers'
  ``mel_filter_bank`` with slaney scale and norm, which is librosa's default;
- ``check_model_inputs()`` became a plain decorator and the ``"default"`` rope initialiser
  left ``ROPE_INIT_FUNCTIONS``;
- the mask builders renamed ``input_embeds`` to ``inputs_embeds`` and dropped
  ``cache_position``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["load"]

_PACKAGES = ("", "core", "inference", "core/models", "core/tokenizer_12hz")


def load() -> tuple[Any, Any, Any, Any]:
    """``(configuration, modeling, tokenizer configuration, tokenizer modeling)`` modules.

    Raises:
        ImportError: qwen-tts is not installed.
    """
    spec = importlib.util.find_spec("qwen_tts")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("qwen-tts is not installed: pip install --no-deps qwen-tts==0.1.1")
    root = Path(next(iter(spec.submodule_search_locations)))
    import transformers.activations
    import transformers.modeling_utils  # noqa: F401
    import transformers.utils.generic as generic
    from transformers import modeling_rope_utils as rope

    original = generic.check_model_inputs

    def check_model_inputs(func: Any = None, **_: Any) -> Any:
        return original if func is None else original(func)

    generic.check_model_inputs = check_model_inputs
    rope.ROPE_INIT_FUNCTIONS.setdefault("default", _default_rope)
    for sub in _PACKAGES:
        name = "qwen_tts" + ("." + sub.replace("/", ".") if sub else "")
        if name not in sys.modules or getattr(sys.modules[name], "__file__", None):
            package = types.ModuleType(name)
            package.__path__ = [str(root / sub)]
            sys.modules[name] = package
    librosa = types.ModuleType("librosa")
    filters = types.ModuleType("librosa.filters")
    filters.mel = _mel  # type: ignore[attr-defined]
    librosa.filters = filters  # type: ignore[attr-defined]
    sys.modules.setdefault("librosa", librosa)
    sys.modules.setdefault("librosa.filters", filters)
    # The model module imports the tokenizer wrapper only to name it in from_pretrained.
    wrapper = types.ModuleType("qwen_tts.inference.qwen3_tts_tokenizer")
    wrapper.Qwen3TTSTokenizer = object  # type: ignore[attr-defined]
    sys.modules["qwen_tts.inference.qwen3_tts_tokenizer"] = wrapper
    cfg = importlib.import_module("qwen_tts.core.models.configuration_qwen3_tts")
    model = importlib.import_module("qwen_tts.core.models.modeling_qwen3_tts")
    tcfg = importlib.import_module(
        "qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2"
    )
    tmod = importlib.import_module("qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2")
    for module in (model, tmod):
        for fn in ("create_causal_mask", "create_sliding_window_causal_mask"):
            if hasattr(module, fn):
                setattr(module, fn, _renamed(getattr(module, fn)))
    return cfg, model, tcfg, tmod


def _default_rope(config: Any, device: Any = None, seq_len: Any = None, **_: Any) -> Any:
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    steps = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device)
    return 1.0 / (theta ** (steps / dim)), 1.0


def _mel(*, sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None) -> np.ndarray:
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=n_fft // 2 + 1,
        num_mel_filters=n_mels,
        min_frequency=fmin,
        max_frequency=fmax if fmax is not None else sr / 2,
        sampling_rate=sr,
        norm="slaney",
        mel_scale="slaney",
    )
    return np.ascontiguousarray(bank.T.astype(np.float32))


def _renamed(mask_fn: Any) -> Any:
    @functools.wraps(mask_fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "input_embeds" in kwargs:
            kwargs["inputs_embeds"] = kwargs.pop("input_embeds")
        kwargs.pop("cache_position", None)
        return mask_fn(*args, **kwargs)

    return call
