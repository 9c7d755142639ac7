"""Regenerate the spoken fixtures: ``python tests/realtime/speech/make.py`` with
``pip install espeakng-loader`` (espeak-ng's library and voice data in a wheel).

Each fixture is one English sentence spoken by espeak-ng's default voice, resampled to the
Realtime API's client rate (24 kHz mono) and stored as 16-bit FLAC. The tests only read them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

SENTENCES = {
    "weather": "What is the weather like in Paris today?",
    "story": "Tell me a short story about a dragon.",
    "stop": "Wait, stop, I have another question.",
}
RATE = 24_000
_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: synthesise into the callback, no sound device


def speak(library: ctypes.CDLL, text: str) -> np.ndarray:
    pieces: list[np.ndarray] = []
    callback_type = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
    )

    def collect(wav: ctypes._Pointer, count: int, events: int) -> int:  # type: ignore[type-arg]
        if count > 0:
            pieces.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0

    callback = callback_type(collect)
    library.espeak_SetSynthCallback(callback)
    data = text.encode()
    library.espeak_Synth(data, len(data) + 1, 0, 0, 0, 0, None, None)
    library.espeak_Synchronize()
    return np.concatenate(pieces)


def main() -> None:
    import espeakng_loader  # type: ignore[import-not-found]

    library = ctypes.CDLL(espeakng_loader.get_library_path())
    rate = library.espeak_Initialize(_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0)
    library.espeak_SetVoiceByName(b"en")
    here = Path(__file__).parent
    for name, text in SENTENCES.items():
        pcm = speak(library, text).astype(np.float32) / 32768
        audio = soxr.resample(pcm, rate, RATE)
        sf.write(here / f"{name}.flac", audio, RATE, subtype="PCM_16")
        print(f"{name}.flac: {len(audio) / RATE:.2f} s")


if __name__ == "__main__":
    main()
