"""Vocabulary files for the tokenizer tests, written with the real `gguf.GGUFWriter`.

* `byte_level_vocab`: SmolLM2's byte-level BPE cut to its first tokens (its merges are in token
  order, so a prefix of both stays consistent), plus digit-group tokens so that the digit rules
  of the pre-tokenizers (`\\p{N}`, `\\p{N}{1,3}`, ` ?\\p{N}+`) lead to different ids, and one word
  no merge reaches, which only `ignore_merges` vocabularies (llama3, tekken) emit whole.
* `train_spm`: a tiny SentencePiece BPE model trained on local text (stdlib docstrings and a few
  lines in other scripts) with LLaMA's settings: identity normalisation, no whitespace folding,
  a dummy prefix, split digits, byte fallback.
* `spm_gguf`: that model written the way llama.cpp's converter writes SentencePiece vocabularies
  (`tokens`, `scores`, `token_type` from the piece kinds, BOS/EOS/UNK ids, `add_space_prefix`).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import io
import json
import pathlib
import re
import textwrap
from pathlib import Path
from typing import Any

import gguf
import sentencepiece as spm

from hetero.tokenizer_metadata import read_tokenizer_metadata

NOT_MERGED_WORD = "Ġzyzzyva"  # " zyzzyva" as one token that no merge produces

MULTILINGUAL = [
    "Le café était très bon, n'est-ce pas ? Où est l'hôtel ?",
    "Über die Brücke gehen Mädchen und Jungen.",
    "El niño comió piñas en la mañana.",
    "中文分词是一个重要的问题。我们今天去北京。",
    "日本語のテキストとカタカナのテスト。",
    "한국어 문장도 포함합니다.",
    "Русский текст для проверки токенизатора.",
    "Ελληνικά γράμματα και λέξεις.",
    "Numbers: 3.14159, 2718281828, 1,000,000 and 42.",
]


def write_gguf(path: Path, metadata: dict[str, Any], arch: str = "llama") -> Path:
    """A tensor-less GGUF holding `metadata` (tokenizer keys, typed as llama.cpp writes them)."""
    w = gguf.GGUFWriter(str(path), arch)
    adders = {
        "tokenizer.ggml.model": w.add_tokenizer_model,
        "tokenizer.ggml.pre": w.add_tokenizer_pre,
        "tokenizer.ggml.tokens": w.add_token_list,
        "tokenizer.ggml.token_type": w.add_token_types,
        "tokenizer.ggml.scores": w.add_token_scores,
        "tokenizer.ggml.merges": w.add_token_merges,
        "tokenizer.chat_template": w.add_chat_template,
    }
    for key, value in metadata.items():
        if key in adders:
            adders[key](value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_level_vocab(smollm2_path: Path, n_tokens: int = 6000) -> dict[str, Any]:
    """Metadata of a reduced, digit-extended SmolLM2 vocabulary (see the module docstring)."""
    meta = read_tokenizer_metadata(smollm2_path)
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = list(meta["tokenizer.ggml.merges"])
    first_merged = len(tokens) - len(merges)  # token first_merged + k is made by merges[k]
    tokens, merges = tokens[:n_tokens], merges[: n_tokens - first_merged]
    types = list(meta["tokenizer.ggml.token_type"][:n_tokens])
    extra: list[tuple[str, str | None]] = []
    for a in "0123456789":
        extra.append((f"Ġ{a}", f"Ġ {a}"))
        for b in "0123456789":
            extra.append((a + b, f"{a} {b}"))
            extra.extend((a + b + c, f"{a}{b} {c}") for c in "0123456789")
    extra.append((NOT_MERGED_WORD, None))
    for token, merge in extra:
        tokens.append(token)
        types.append(1)
        if merge is not None:
            merges.append(merge)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def _local_corpus() -> list[str]:
    lines = []
    for module in (json, re, collections, textwrap, argparse, pathlib, inspect):
        for obj in (module, *vars(module).values()):
            if inspect.ismodule(obj) or inspect.isfunction(obj) or inspect.isclass(obj):
                doc = inspect.getdoc(obj) or ""
                lines.extend(line for line in doc.splitlines() if line.strip())
    return lines + MULTILINGUAL * 20


def train_spm(vocab_size: int = 1200) -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_local_corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def spm_metadata(sp: spm.SentencePieceProcessor) -> dict[str, Any]:
    """What llama.cpp's converter (`_create_vocab_sentencepiece`) writes for this model."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
