"""text_similarity's metrics, each a score in [0, 1] from the library that defines it: fuzzy_match (rapidfuzz's
WRatio over default-processed text, as OpenAI's own example grader computes it), bleu (sacrebleu's sentence BLEU),
gleu (nltk's sentence GLEU), meteor (nltk's METEOR on exact words and Porter stems only: WordNet's synonyms would
need a corpus download, and nothing is downloaded at run time), rouge_1..rouge_5 and rouge_l (rouge-score's F1).
cosine needs an embedding model and is refused by check()."""

from __future__ import annotations

import functools
import math
import re
from typing import Any

_WORDS = re.compile(r"\w+|[^\w\s]")
EMBEDDING_METRICS = ("cosine",)


class _NoWordNet:
    """Stands in for nltk's WordNet reader: no synonyms, so METEOR matches exact words and stems."""

    def synsets(self, word: str) -> list[Any]:
        return []


def words(text: str) -> list[str]:
    """The tokens GLEU and METEOR compare: runs of word characters, and each other non-space character."""
    return _WORDS.findall(text)


@functools.lru_cache(maxsize=8)
def _rouge(kind: str):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([kind])


def _fuzzy(hyp: str, ref: str) -> float:
    from rapidfuzz import fuzz, utils

    return fuzz.WRatio(hyp, ref, processor=utils.default_process) / 100.0


def _bleu(hyp: str, ref: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_bleu(hyp, [ref]).score / 100.0


def _gleu(hyp: str, ref: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    h, r = words(hyp), words(ref)
    return float(sentence_gleu([r], h)) if h and r else 0.0


def _meteor(hyp: str, ref: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    h, r = words(hyp), words(ref)
    return float(meteor_score([r], h, wordnet=_NoWordNet())) if h and r else 0.0  # type: ignore[arg-type]


def _rouge_f1(kind: str, hyp: str, ref: str) -> float:
    return float(_rouge(kind).score(ref, hyp)[kind].fmeasure)


def similarity(metric: str, hyp: str, ref: str) -> float:
    """`hyp` (the grader's rendered input) against `ref` (its reference) by `metric`, clamped to [0, 1]."""
    if metric == "fuzzy_match":
        value = _fuzzy(hyp, ref)
    elif metric == "bleu":
        value = _bleu(hyp, ref)
    elif metric == "gleu":
        value = _gleu(hyp, ref)
    elif metric == "meteor":
        value = _meteor(hyp, ref)
    elif metric.startswith("rouge_"):
        value = _rouge_f1(f"rouge{metric.removeprefix('rouge_').upper()}", hyp, ref)
    else:
        raise ValueError(f"{metric} is not a metric computed here")
    if not math.isfinite(value):
        return 0.0
    return min(1.0, max(0.0, value))
