"""The text side: a byte-level tokenizer for the seeded sizes, and the upstream layout for real
checkpoints.

The seeded sizes use a tokenizer built in code (256 byte tokens, BOS, end-of-text, end-of-turn,
then Orpheus' ``<custom_token_N>`` control tokens): it needs no file or network, any text
encodes, and its small vocabulary keeps the LM head, which also spans the 28 672 audio
codes, cheap. It is a real ``tokenizers.Tokenizer``, so it saves to ``tokenizer.json`` and a
folder written with it loads like a released checkpoint.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from mstar_async.models.checkpoints import ChatTokenizer, CheckpointError
from mstar_async.models.orpheus.vocab import CONTROL_TOKENS, OrpheusVocab

BOS = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
END_OF_TURN = "<|eot_id|>"


def byte_tokenizer() -> ChatTokenizer:
    """A byte-level tokenizer: ids 0..255 are the 256 byte tokens, then BOS, end-of-text and
    end-of-turn (256..258), then ``<custom_token_0..9>`` (259..268). Encoding adds BOS, as
    Llama 3's does. Never raises."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, END_OF_TEXT, END_OF_TURN]
    specials += [f"<custom_token_{n}>" for n in range(CONTROL_TOKENS)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, len(alphabet))]
    )
    return ChatTokenizer(tok, bos_token=BOS, eos_token=END_OF_TURN)


def vocab_of(tokenizer: ChatTokenizer) -> OrpheusVocab:
    """Orpheus' layout in ``tokenizer``: custom tokens from ``<custom_token_0>``'s id.

    Raises:
        CheckpointError: the tokenizer lacks ``<custom_token_0>``, BOS or ``<|eot_id|>``.
    """
    ids = {}
    for name in ("<custom_token_0>", BOS, END_OF_TURN):
        token_id = tokenizer.token_to_id(name)
        if token_id is None:
            raise CheckpointError(
                f"the tokenizer has no {name!r}: an Orpheus checkpoint's tokenizer.json holds "
                "Llama 3's special tokens and <custom_token_N>"
            )
        ids[name] = token_id
    return OrpheusVocab(
        custom_base=ids["<custom_token_0>"], bos=ids[BOS], end_of_text=ids[END_OF_TURN]
    )
