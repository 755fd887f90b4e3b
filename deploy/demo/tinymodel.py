"""Build a small Llama-architecture model and tokenizer locally (no hub): for tests, benchmarks and the demo.

python deploy/demo/tinymodel.py OUT_DIR [--hidden 64 --layers 2 --texts FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
DEFAULT_TEXTS = [
    "What is the capital of France? The capital of France is Paris.",
    "How many legs does a spider have? A spider has eight legs.",
    "What colour is the sky on a clear day? The sky is blue on a clear day.",
    "Which planet is known as the red planet? Mars is known as the red planet.",
]


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(
    out_dir: str | Path,
    texts: list[str] | None = None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    chat_template: bool = True,
    init_range: float = 0.2,
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(texts or DEFAULT_TEXTS, vocab_size)
    if not chat_template:
        tokenizer.chat_template = None
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=init_range,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--texts", nargs="+", help="JSON-lines files of {q, a} pairs to fit the tokenizer on")
    args = ap.parse_args()
    texts = None
    if args.texts:
        texts = [
            f"{r['q']} {r['a']}"
            for path in args.texts
            for r in map(json.loads, Path(path).read_text().splitlines())
            if r
        ]
    build(
        args.out_dir,
        texts,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab_size=args.vocab,
    )
    print(args.out_dir)


if __name__ == "__main__":
    main()
