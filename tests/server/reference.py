"""What the runtime itself produces for a request, to compare the HTTP routes against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from mstar_async.models import build_model
from mstar_async.outputs import TextEnd
from mstar_async.runtime import open_runtime


def runtime_outputs(folder: Path, **inputs: Any) -> tuple[str, TextEnd]:
    """The text and the closing ``TextEnd`` of one request on a fresh tiny-Llama runtime."""

    async def run() -> tuple[str, TextEnd]:
        model = build_model("causal-lm", path=folder, dtype="float32")
        async with open_runtime(model) as runtime, runtime.generate(**inputs) as outputs:
            items = [item async for item in outputs]
        end = items.pop()
        assert isinstance(end, TextEnd)
        return "".join(item.text for item in items), end

    return anyio.run(run)
