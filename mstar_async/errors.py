"""Every exception mstar_async raises on purpose, in one tree.

    MstarError
    ├── GraphError            a model's graph or walks break a rule (raised when the model is built)
    ├── WalkInputError        a walk was called without an input it needs, or with an unknown one
    ├── PolicyError           a chunk policy was misused (push after close, mixed item kinds)
    ├── SessionClosed         text was pushed to a speech session that takes no more input
    ├── EngineError           an engine could not run a step (bad op, bad shapes, missing outputs)
    │   └── KVCacheFull       the paged KV cache has no free block for a step
    ├── QuantizationUnsupported  this torch has no weight-only kernel a quantized form needs here
    ├── RequestError          a request failed; ``__cause__`` holds what went wrong inside it
    │   └── RequestCancelled  the request was cancelled before it finished
    ├── WorkerLost            a worker process died with requests in flight
    ├── TensorNotHeld         a tensor handle outlived its tensor (request released, restart)
    ├── PlacementError        a placement names an unknown node or rank, or cannot connect a walk
    ├── SourceRefused         a joining worker was asked to build a model it was not allowed to
    ├── ModelNotFound         no model of that name is registered in the zoo
    └── VoiceError            a registered voice cannot be made or used
        ├── VoiceNotFound     no registered voice has that id
        └── VoiceLimitError   the voice registry or a reference recording is past its limits

Argument checks on constructors raise plain ``ValueError`` / ``TypeError`` naming the argument,
as the standard library does; everything raised while serving derives from ``MstarError``.
"""

from __future__ import annotations


class MstarError(Exception):
    """Base of every error mstar_async raises on purpose."""


class GraphError(MstarError):
    """A model's graph or walks break a rule; the message names the culprit and the fix."""


class WalkInputError(MstarError):
    """A walk was called without an input it needs, or with an input it does not take."""


class PolicyError(MstarError):
    """A chunk policy was used against its contract (push after close, mixed item kinds)."""


class SessionClosed(MstarError):
    """Text was pushed to a speech session after its ``end_input()`` or ``aclose()``."""


class EngineError(MstarError):
    """An engine could not run a step: unknown op, inputs it cannot batch, missing outputs."""


class KVCacheFull(EngineError):
    """The paged KV cache has no free block left for a step."""


class QuantizationUnsupported(MstarError):
    """A quantized weight form was asked for on a device where this torch build lacks one of
    the weight-only kernels it runs on; the message names the operators and the device."""


class RequestError(MstarError):
    """A request failed; ``__cause__`` carries the underlying error."""


class RequestCancelled(RequestError):
    """The request was cancelled (client gone, barge-in, timeout) before it finished."""


class WorkerLost(MstarError):
    """A worker process died while it had requests in flight; the message names its rank."""


class TensorNotHeld(MstarError):
    """A tensor handle names a tensor its worker no longer holds: the request was released, or
    the worker restarted since the handle was made."""


class PlacementError(MstarError):
    """A placement names an unknown node or rank, or cuts a walk's nodes off from each other."""


class SourceRefused(MstarError):
    """A worker that joined over the network was asked to build a model source its command line
    does not allow; the message names what was asked and what is allowed."""


class ModelNotFound(MstarError):
    """No model of the requested name is registered in the zoo."""


class VoiceError(MstarError):
    """A registered voice cannot be made or used (a bad recording, a model that cannot clone)."""


class VoiceNotFound(VoiceError):
    """No registered voice has that id (or it was deleted)."""


class VoiceLimitError(VoiceError):
    """The voice registry is full, or a reference recording is longer or larger than allowed;
    the message names the limit."""
