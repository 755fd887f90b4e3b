"""One pad id for every batch and every generate call (trainer/model.py pad_id): the tokenizer's pad token where it
has one, id 0 included (a real id, not a missing one), else its eos."""

from __future__ import annotations

from transformers import AutoTokenizer

from trainer.model import pad_id


def test_the_pad_id_is_the_pad_token_id_0_included_else_eos(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assert tok.eos_token_id is not None and tok.eos_token_id != 0
    tok.pad_token = tok.convert_ids_to_tokens(0)
    assert tok.pad_token_id == 0 and pad_id(tok) == 0  # `pad_token_id or eos_token_id` gave eos here
    tok.pad_token = None
    assert tok.pad_token_id is None and pad_id(tok) == tok.eos_token_id
