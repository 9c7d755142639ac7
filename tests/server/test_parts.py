"""The server's pure parts: admission, error fields, output encodings."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.graph import Model, Node, Walk
from mstar_async.outputs import LatentOutput, TextDelta
from mstar_async.server.admission import Admission
from mstar_async.server.encode import encode_output, pcm_s16le, png
from mstar_async.server.errors import APIError, from_validation
from mstar_async.server.program_inputs import ProgramInputs
from mstar_async.server.schemas import ChatCompletionRequest, decode


@given(st.lists(st.booleans(), max_size=40), st.integers(1, 5))
def test_admission_never_exceeds_its_limit(enters: list[bool], limit: int) -> None:
    admission, held = Admission(limit), []
    for enter in enters:
        if enter:
            ticket = admission.try_enter()
            assert (ticket is None) == (len(held) == limit)
            if ticket is not None:
                held.append(ticket)
        elif held:
            ticket = held.pop()
            ticket.release()
            ticket.release()  # idempotent
        assert admission.in_flight == len(held) <= limit


def test_admission_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        Admission(0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
        (b'{"model": "m", "messages": [{}]}', "messages[0].role"),
        (b"{not json", None),
    ],
)
def test_validation_errors_name_the_field(body: bytes, param: str | None) -> None:
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)) as caught:
        decode(body, ChatCompletionRequest)
    error = from_validation(caught.value)
    assert (error.status, error.param) == (400, param)
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_pcm_is_clipped_little_endian_int16() -> None:
    data = pcm_s16le(torch.tensor([0.0, 0.5, -1.0, 2.0]))
    assert data == b"\x00\x00" + (16384).to_bytes(2, "little") + b"\x01\x80" + b"\xff\x7f"


def test_png_rejects_shapes_it_cannot_hold() -> None:
    assert png(torch.zeros(1, 2, 3)).startswith(b"\x89PNG")
    with pytest.raises(ValueError, match=r"\[1\|3\|4, H, W\]"):
        png(torch.zeros(2, 4, 4))


def test_outputs_encode_by_type() -> None:
    assert encode_output(TextDelta("hé")) == {"type": "text", "text": "hé"}
    latent = encode_output(LatentOutput(torch.ones(2, 1), step=3))
    assert latent == {"type": "latent", "step": 3, "shape": [2, 1], "data": [[1.0], [1.0]]}
    with pytest.raises(TypeError, match="no HTTP encoding for output type str"):
        encode_output("text")


class Handle:
    """A type JSON cannot describe."""


def test_program_inputs_check_what_json_can_carry_and_pass_the_rest() -> None:
    class Local:  # a name the annotation cannot resolve from the module
        pass

    async def program(
        request: Any,
        n: int = 1,
        tags: list[str] | None = None,
        handle: Handle | None = None,
        local: Local | None = None,
    ) -> AsyncGenerator[Any, None]:
        yield n

    model = Model(
        "typed",
        nodes=[Node("a", engine="e", inputs=["x"], outputs=["y"])],
        walks=[Walk("w", "a")],
        program=program,
        components={"e": lambda: None},
    )
    inputs = ProgramInputs(model)
    given = {"n": 2, "tags": ["a"], "handle": Handle(), "local": Local()}
    assert inputs.convert(given) == given
    with pytest.raises(APIError) as wrong:
        inputs.convert({"tags": ["a", 3]})
    assert (wrong.value.status, wrong.value.param) == (400, "inputs.tags[1]")


def test_a_model_with_a_launcher_needs_a_placement() -> None:
    from mstar_async.models import build_model
    from mstar_async.server import ModelSpec, create_app
    from mstar_async.worker.launchers import LocalLauncher

    spec = ModelSpec(build_model("demo"), make_launcher=LocalLauncher)
    with pytest.raises(ValueError, match="'demo' has a launcher but no placement"):
        create_app([spec])
