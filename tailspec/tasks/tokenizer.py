"""A character-level tokenizer built locally (no hub): a `PreTrainedTokenizerFast` over the task's
alphabet, saved with `save_pretrained` and loaded back with `AutoTokenizer.from_pretrained`.

A small vocabulary (72 ids) keeps the exact-sampling tests enumerable and the policies small.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
ALPHABET = "0123456789+=;,#:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own token; the decoder glues them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="left", model_max_length=4096,
    )
    return fast


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    tokenizer.save_pretrained(str(path))


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str) -> list[int]:
    """BOS + characters. Raises ValueError on characters outside the alphabet (they would map to UNK)."""
    bad = sorted({c for c in prompt if c not in ALPHABET})
    if bad:
        raise ValueError(f"prompt has characters outside the task alphabet: {bad!r}")
    return [tokenizer.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False)


def decode_response(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """Text of a response up to (not including) the first EOS; special tokens dropped."""
    eos = tokenizer.eos_token_id
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True)
