"""Tiny models for tests, benchmarks and the CPU demo, built from a config with no download.

`build_tiny_model(folder, ...)` writes a Hugging Face folder: a Llama-style config (RoPE, head_dim
>= 32 because vLLM's CPU kernels need it), randomly initialised weights (safetensors), and a
character-level tokenizer built with `tokenizers` (printable ASCII and newline, plus pad/bos/eos/unk).
`AutoModelForCausalLM`, `AutoTokenizer` and vLLM all load that folder from disk.

Deliberate simplification: one character per token and no chat template, so prompts are plain text
(the roles module then uses its plain templates).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # tiny models load in milliseconds; bars only clutter the demo

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII + space + newline


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_llama_config(
    vocab_size: int, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4, **extra: Any
) -> LlamaConfig:
    """A small Llama config: MLP 4x wide, as many key/value heads as heads; `extra` sets any other field."""
    shape = {
        "intermediate_size": hidden_size * 4,
        "num_key_value_heads": num_heads,
        "head_dim": hidden_size // num_heads,
    }
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        **(shape | extra),
    )


def build_tiny_model(
    folder: str | Path,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    **config: Any,
) -> Path:
    """Write a tiny Llama-style model and its tokenizer to `folder`; returns the folder. `config` sets
    any other field of its `LlamaConfig` (untied embeddings, fp32 by default)."""
    if hidden_size // num_heads < 32:
        raise ValueError(
            f"tiny model: head_dim={hidden_size // num_heads} (hidden_size/num_heads) "
            "must be >= 32 for vLLM's CPU kernels"
        )
    folder = Path(folder)
    tokenizer = build_tiny_tokenizer()
    config = tiny_llama_config(
        len(tokenizer),
        hidden_size,
        num_layers,
        num_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"tie_word_embeddings": False, "torch_dtype": "float32"} | config),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
