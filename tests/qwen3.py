"""A random-init Qwen3 with Qwen3's real tokenizer and chat template (`tests/data/qwen3-tokenizer`, see
its README for provenance), to test the real-model path: no weights can be downloaded here.

The model is sized for speed (hidden 32, 2 layers); the vocabulary is Qwen3's real 151,936 rows, so
the output layer, sampling and log-probs see a real model's vocabulary."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

DATA = Path(__file__).parent / "data" / "qwen3-tokenizer"


def qwen3_tokenizer_files(folder: Path) -> Path:
    """Qwen3's `tokenizer.json` (unpacked) and `tokenizer_config.json` in `folder`; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(DATA / "tokenizer.json.gz", "rb") as src, open(folder / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(DATA / "tokenizer_config.json", folder / "tokenizer_config.json")
    return folder


# Qwen3-0.6B's shape (the benchmarks' real-size model; `qwen3_config(..., **QWEN3_0_6B)`).
QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28}
QWEN3_0_6B |= {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}


def qwen3_config(max_position_embeddings: int = 2048, **shape):
    """A Qwen3Config with Qwen3's real vocabulary and special tokens, tied embeddings, and the small test
    shape (hidden 32, 2 layers) unless `shape` says otherwise (any field of the config)."""
    from transformers import Qwen3Config

    sizes = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    qwen3 = dict(vocab_size=151936, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    return Qwen3Config(max_position_embeddings=max_position_embeddings, pad_token_id=151643, **(qwen3 | sizes | shape))


def build_qwen3(folder: Path, max_position_embeddings: int = 2048, seed: int = 0) -> Path:
    """Save a random-init Qwen3ForCausalLM and the real tokenizer to `folder`; returns it."""
    import torch
    from transformers import Qwen3ForCausalLM

    qwen3_tokenizer_files(folder)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(qwen3_config(max_position_embeddings)).save_pretrained(folder)
    return folder
