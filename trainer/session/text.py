"""A sample asked in text (the gateway's OpenAI-compatible routes): its prompt, given as text or as a chat the base
model's chat template renders, becomes tokens with the session's own tokenizer, and each sampled sequence comes
back with its text beside its tokens. A sample asked in tokens (Tinker's) passes through unchanged."""

from __future__ import annotations

import msgspec

from schemas.sessions import Sample, SampleResult
from trainer.session.model import CallRefused


def tokenized(tokenizer, call: Sample) -> Sample:
    """The call with its text or chat prompt as token ids."""
    if call.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise CallRefused(
                "messages: the base model's tokenizer has no chat template; render the prompt yourself and send it "
                "to /v1/completions",
                "messages",
            )
        chat = [{"role": m.role, "content": m.content} for m in call.messages]
        prompt = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):  # transformers 5 answers a BatchEncoding
            prompt = prompt["input_ids"]
        return msgspec.structs.replace(call, prompt=list(prompt), messages=None)
    if call.text is not None:
        return msgspec.structs.replace(call, prompt=tokenizer.encode(call.text), text=None)
    return call


def with_texts(tokenizer, asked_in_text: bool, call: Sample, result: SampleResult) -> SampleResult:
    """Each sequence's text (its stop token left out), and the prompt's length, for a sample asked in text."""
    if not asked_in_text:
        return result
    for s in result.sequences:
        text = tokenizer.decode(s.tokens, skip_special_tokens=True)
        cuts = [at for at in (text.find(stop) for stop in call.stop_strings) if at >= 0]
        s.text = text[: min(cuts)] if cuts else text  # as OpenAI answers: the stop string left out
    result.prompt_tokens = len(call.prompt)
    return result
