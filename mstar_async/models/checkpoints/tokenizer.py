"""``ChatTokenizer``: a ``tokenizers.Tokenizer`` plus the chat template and stop tokens."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from mstar_async.models.checkpoints.chat_template import render_chat_template
from mstar_async.models.checkpoints.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
#: Texts longer than this are encoded with the GIL released (see ``ChatTokenizer.encode``).
LONG_TEXT_CHARS = 16_384
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as a serialized
    # AddedToken ({"content": ..., "special": true, ...}).
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class ChatTokenizer:
    """Text <-> token ids, chat prompts, and the ids that end a generation.

    Wraps a ``tokenizers.Tokenizer`` (the same object transformers' fast tokenizers use) and
    renders the chat template the way transformers does.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        """Wrap ``tokenizer``; the stop ids are ``extra_eos_token_ids`` plus ``eos_token``'s id.

        Raises ``CheckpointError`` if ``bos_token`` or ``eos_token`` is not in the vocabulary.
        """
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._lookup(bos_token, "bos_token")
        eos_id = self._lookup(eos_token, "eos_token")
        ids = set(extra_eos_token_ids)
        if eos_id is not None:
            ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)

    def _lookup(self, token: str | None, role: str) -> int | None:
        if token is None:
            return None
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{role} {token!r} is not in the tokenizer's vocabulary")
        return int(token_id)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTokenizer:
        """Load ``tokenizer.json`` and, if present, ``tokenizer_config.json`` (chat template,
        bos/eos tokens), ``chat_template.jinja`` (which wins over the config's template) and
        ``generation_config.json`` (``eos_token_id``, an int or a list).

        Raises ``CheckpointError`` naming the file if ``tokenizer.json`` is missing or any of
        the files cannot be parsed.
        """
        folder = Path(folder)
        tokenizer_path = folder / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise CheckpointError(
                f"{tokenizer_path} is missing: put the Hugging Face fast-tokenizer file "
                f"({TOKENIZER_FILE}, as written by tokenizer.save_pretrained) there"
            )
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise CheckpointError(f"cannot parse {tokenizer_path}: {exc}") from exc

        config_path = folder / TOKENIZER_CONFIG_FILE
        config = _read_json(config_path) if config_path.is_file() else {}
        generation_path = folder / GENERATION_CONFIG_FILE
        generation = _read_json(generation_path) if generation_path.is_file() else {}

        template = config.get("chat_template")
        template_path = folder / CHAT_TEMPLATE_FILE
        if template_path.is_file():
            # Recent transformers versions save the template beside tokenizer_config.json and
            # prefer that file when both exist.
            template = template_path.read_text(encoding="utf-8")
        if isinstance(template, list):
            # Some checkpoints ship named templates; "default" is the one transformers picks.
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(
            tokenizer,
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            extra_eos_token_ids=_id_list(generation.get("eos_token_id")),
        )

    @property
    def tokenizer(self) -> Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: its longest vocabulary entry (a byte-level
        entry's length is its bytes, at least the characters it covers)."""
        return max(
            (len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True)), default=1
        )

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (exact vocabulary string), or ``None`` if it has none."""
        token_id = self._tokenizer.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for ``text``; special-token strings inside it map to their ids.

        ``add_special_tokens`` applies the tokenizer's post-processor (e.g. a leading BOS).
        A long text is encoded with the GIL released, so a thread encoding it leaves the
        process's other threads (an event loop) running.
        """
        if len(text) > LONG_TEXT_CHARS:
            # ``encode`` holds the GIL for the whole text (half a second for 500 KB here);
            # ``encode_batch`` gives the same ids and lets other threads run meanwhile.
            batch = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(batch[0].ids)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; special tokens are dropped unless ``skip_special_tokens`` is false."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``) into a prompt string.

        ``extra`` keyword arguments become template variables (e.g. ``tools``).
        Raises ``CheckpointError`` if the checkpoint has no chat template, ``ChatTemplateError``
        (a ``CheckpointError``) if the template does not compile, and ``ConversationRejected``
        (a ``ChatTemplateError`` and a ``ValueError``) if it cannot render ``messages``.
        """
        if self.chat_template is None:
            raise CheckpointError(
                'this tokenizer has no chat template: add a "chat_template" string to '
                f"{TOKENIZER_CONFIG_FILE}"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def __repr__(self) -> str:
        return (
            f"ChatTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos_ids={sorted(self.eos_token_ids)})"
        )
