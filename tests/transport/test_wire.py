"""Message structs: framing round trips, errors re-raised by class."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given

from mstar_async.engines.sampling import SamplingParams
from mstar_async.errors import EngineError, KVCacheFull, MstarError, RequestCancelled
from mstar_async.policies import Chunk
from mstar_async.transport import (
    DropState,
    ErrorInfo,
    FeedWalk,
    FetchState,
    FetchTensor,
    Hello,
    Message,
    Peers,
    Ping,
    Pong,
    Release,
    RemoteError,
    Shutdown,
    StartWalk,
    StateReply,
    StepCall,
    TensorRef,
    TensorReply,
    TransportError,
    decode_message,
    encode_message,
    register_remote_error,
)

from .support import COMPLEX_HALF_WARNING, PROPERTY, assert_same, register_test_wire_types, values

register_test_wire_types()


def round_trip(msg: Message) -> Message:
    return decode_message(encode_message(msg))


PLAIN = [
    Hello(rank=2, pid=1234, endpoint="ipc:///tmp/x/s0", engines=["llm", "codec"]),
    Hello(2, 1234, "tcp://10.0.0.1:5000", ["llm"], peer_endpoint="tcp://10.0.0.2:6000"),
    Peers({0: "ipc:///tmp/a/s1", 3: "tcp://10.0.0.2:6000"}),
    Pong(7, {"tensors_held": 2}),
    StateReply(4, {"h": TensorRef(1, "2.17", (8, 4096), "bfloat16"), "n": 3}),
    Release("req-1"),
    Shutdown(),
    Ping(7),
    Pong(7),
    FetchTensor("kv/3/0", id=4),
    FetchState("req-1", "lm", id=5),
    DropState("req-1", "lm"),
    StartWalk(2, "req-1", "decode", moves={"lm": 0}),
    StateReply(3, error=ErrorInfo("KVCacheFull", "no block", "tb")),
]


@pytest.mark.parametrize("msg", PLAIN, ids=lambda m: type(m).__name__)
def test_plain_messages_round_trip(msg: Message) -> None:
    frames = encode_message(msg)
    assert len(frames) == 1
    assert round_trip(msg) == msg


@pytest.mark.filterwarnings(COMPLEX_HALF_WARNING)
@PROPERTY
@given(values, values)
def test_value_carrying_messages_round_trip(inputs: Any, outputs: Any) -> None:
    feed = FeedWalk(9, "talker.x", {"x": inputs})
    out = round_trip(feed)
    assert isinstance(out, FeedWalk)
    assert (out.id, out.port, out.end) == (9, "talker.x", False)
    assert_same(feed.items, out.items)
    reply = round_trip(StateReply(9, outputs))
    assert isinstance(reply, StateReply) and reply.error is None
    assert_same(outputs, reply.state)
    tensor_reply = round_trip(TensorReply("ref", 1, outputs))
    assert isinstance(tensor_reply, TensorReply)
    assert_same(outputs, tensor_reply.value)


def test_decode_step_message_frames_and_zero_copy() -> None:
    tokens = torch.arange(8, dtype=torch.int64)
    hidden = torch.randn(8, 4096).to(torch.bfloat16)
    chunk = Chunk(torch.randint(0, 4096, (28, 7)), start=21, context=7, lookahead=14)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    msg = FeedWalk(1, "llm.x", {"t": tokens, "h": hidden, "c": chunk, "s": params})
    frames = encode_message(msg)
    assert len(frames) == 2  # header (with the small tensors) + the hidden states
    out = decode_message(frames)
    assert isinstance(out, FeedWalk)
    assert out.items["h"].data_ptr() == hidden.data_ptr()  # in-process: the same memory
    assert out.items["c"] == chunk and out.items["s"] == params


def test_encode_rejects_non_messages_and_bad_values() -> None:
    with pytest.raises(TransportError, match="not a message"):
        encode_message(StepCall("r", "e", "o", {}))  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="builtins.object"):
        encode_message(FeedWalk(1, "n.x", {"x": object()}))


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "empty"),
        ([b"\x92\xa4nope\x01"], "malformed"),
        ([msgspec.msgpack.encode(["feed"])], "malformed"),
    ],
    ids=["empty", "unknown-tag", "missing-fields"],
)
def test_decode_rejects_malformed_frames(frames: list[bytes], match: str) -> None:
    with pytest.raises(TransportError, match=match):
        decode_message(frames)


# ---- errors across processes ----------------------------------------------------------------


@pytest.mark.parametrize("cls", [KVCacheFull, EngineError, RequestCancelled, TransportError])
def test_known_errors_come_back_as_their_class(cls: type[MstarError]) -> None:
    try:
        raise cls("it broke")
    except MstarError as exc:
        reply = round_trip(StateReply(5, error=ErrorInfo.from_exception(exc)))
    assert isinstance(reply, StateReply) and reply.error is not None
    assert reply.error.type == cls.__name__
    with pytest.raises(cls, match="it broke") as info:
        raise reply.error.to_exception()
    assert type(info.value) is cls
    assert any("remote traceback" in note and "it broke" in note for note in info.value.__notes__)


def test_unknown_errors_come_back_as_remote_error_with_the_type_name() -> None:
    reply = round_trip(StateReply(1, error=ErrorInfo.from_exception(KeyError("k"))))
    assert isinstance(reply, StateReply) and reply.error is not None
    with pytest.raises(RemoteError, match="KeyError") as info:
        raise reply.error.to_exception()
    assert info.value.remote_type == "KeyError"
    assert isinstance(info.value, MstarError)

    class PluginError(Exception):
        pass

    info2 = ErrorInfo.from_exception(PluginError("p"), with_traceback=False)
    assert info2.type.endswith("PluginError") and "." in info2.type
    assert info2.traceback == ""
    # Forwarding a RemoteError keeps the original class name and message.
    forwarded = ErrorInfo.from_exception(info2.to_exception())
    assert (forwarded.type, forwarded.message) == (info2.type, "p")


def test_registered_errors_are_extensible() -> None:
    class PluginFailure(MstarError):
        pass

    register_remote_error(PluginFailure)
    register_remote_error(PluginFailure)  # again: a no-op
    assert isinstance(ErrorInfo.from_exception(PluginFailure("x")).to_exception(), PluginFailure)
    with pytest.raises(TypeError):
        register_remote_error(ValueError)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already taken"):
        register_remote_error(PluginFailure, name="KVCacheFull")


def test_a_class_with_another_constructor_falls_back_to_remote_error() -> None:
    class Picky(MstarError):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(a, b)

    register_remote_error(Picky, name="tests.Picky")
    exc = ErrorInfo("tests.Picky", "msg").to_exception()
    assert type(exc) is RemoteError and exc.remote_type == "tests.Picky"
