"""Load upstream V-JEPA 2-AC weights (a ``.pt`` file) into the encoder and predictor by name.

Upstream saves one torch file holding an ``encoder`` (or ``target_encoder``) and a
``predictor`` state dict, with ``module.`` and ``backbone.`` prefixes from its training
wrappers. The predictor's ``extrinsics_encoder`` is unused by the model without extrinsics
and is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from mstar_async.models.checkpoints.errors import CheckpointError
from mstar_async.models.vjepa2.modules import ACPredictor, VisionEncoder

_PREFIXES = ("module.", "backbone.")
_UNUSED = ("extrinsics_encoder.",)


def _strip(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    clean: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name, changed = name[len(prefix) :], True
        if not name.startswith(_UNUSED):
            clean[name] = value
    return clean


def _load(module: nn.Module, state: Mapping[str, torch.Tensor], what: str, path: Path) -> None:
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(n for n in set(own) & set(state) if own[n].shape != state[n].shape)
    if missing or unexpected or wrong:
        detail = "; ".join(
            f"{label}: {names[:4]}{' ...' if len(names) > 4 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
            if names
        )
        raise CheckpointError(
            f"{path}: the {what} does not match this vjepa2 size ({detail}); build the model "
            "with the size (or overrides) the checkpoint was trained at"
        )
    module.load_state_dict(state)


def load_upstream(path: str | Path, encoder: VisionEncoder, predictor: ACPredictor) -> None:
    """Copy the weights in the upstream checkpoint ``path`` into ``encoder`` and ``predictor``.

    Raises:
        CheckpointError: the file is missing or unreadable, lacks an encoder or predictor, or
            its tensors do not match the modules' names and shapes (the message lists them).
    """
    file = Path(path)
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot read a V-JEPA 2-AC checkpoint ({exc})") from exc
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{file}: expected a dict of state dicts, got {type(saved).__name__}")
    encoder_state = saved.get("encoder", saved.get("target_encoder"))
    predictor_state = saved.get("predictor")
    if not isinstance(encoder_state, Mapping) or not isinstance(predictor_state, Mapping):
        raise CheckpointError(
            f"{file}: expected 'encoder' (or 'target_encoder') and 'predictor' state dicts; "
            f"found keys {sorted(saved)}"
        )
    _load(encoder, _strip(encoder_state), "encoder", file)
    _load(predictor, _strip(predictor_state), "predictor", file)
