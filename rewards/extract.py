"""The deterministic document extractor ([scorer] extract = "last_document"): which assistant message
holds the final document, with the chatter around it taken off. No model is involved, so a small judge
that cannot copy a document out (SmolLM2-135M returns titles) still gives BLEU a document to compare.
Called by rollout/score.py; docs/rewards.md says what it measures and where it is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from parley.protocol.messages import ChatMessage

# A message needs this many words, chatter removed, to count as a document rather than a question or
# a remark; a short draft paragraph passes, "What tone would you like?" does not.
MIN_DOCUMENT_WORDS = 25
# Lines longer than this are content even when they open with "Sure" or close with a question.
_CHATTER_MAX_WORDS = 30

_OPENERS = re.compile(
    r"^(sure|certainly|of course|absolutely|great|okay|ok|alright|no problem|thanks|thank you|"
    r"here is|here's|here are|below is|i'd be happy|i would be happy|i'm happy|i am happy|happy to|"
    r"i'd love to|i can help|i've (written|drafted|revised|updated)|i have (written|drafted|revised|updated))\b",
    re.IGNORECASE,
)
_CLOSERS = re.compile(
    r"^(let me know|i hope|hope this|feel free|would you like|do you want|if you('d| would)? like|please let|"
    r"is there anything|shall i|should i|what do you think|does this|how does this|i can also|i'd be happy|"
    r"i would be happy|happy to)\b",
    re.IGNORECASE,
)
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")


def _words(text: str) -> int:
    return len(text.split())


def _plain(line: str) -> str:
    """A line without markdown emphasis or heading marks, for matching chatter."""
    return line.strip().lstrip("#>*_- ").strip()


def _is_opener(line: str) -> bool:
    text = _plain(line)
    if _words(text) > _CHATTER_MAX_WORDS:
        return False
    return bool(_OPENERS.match(text)) or text.endswith(":")


def _is_closer(line: str) -> bool:
    text = _plain(line)
    if _words(text) > _CHATTER_MAX_WORDS:
        return False
    return bool(_CLOSERS.match(text)) or text.endswith("?")


def strip_chatter(text: str) -> str:
    """`text` without the assistant's leading preamble lines ("Sure! Here's a draft:") and trailing
    offers and questions ("Let me know if ...", "Would you like ...?"); the lines between are kept
    exactly, blank lines included."""
    lines = text.strip().splitlines()
    start, end = 0, len(lines)
    while start < end and (not lines[start].strip() or _is_opener(lines[start])):
        start += 1
    while end > start and (not lines[end - 1].strip() or _is_closer(lines[end - 1])):
        end -= 1
    return "\n".join(lines[start:end]).strip()


def looks_like_document(text: str) -> bool:
    """At least MIN_DOCUMENT_WORDS words, and fewer than half of its sentences are questions."""
    if _words(text) < MIN_DOCUMENT_WORDS:
        return False
    ends = _SENTENCE_END.findall(text)
    questions = sum("?" in e for e in ends)
    return questions * 2 < max(1, len(ends))


# Where the document BLEU compares comes from: the judge copies it out ("judge"), or the newest
# assistant message that looks like a document, chatter stripped (last_document below; no model).
EXTRACTORS = ("judge", "last_document")


def last_document(messages: Sequence[ChatMessage]) -> str:
    """The newest assistant message that looks like a document, without its chatter; "" when the
    assistant never wrote one (only asked questions, or only short replies).

    The newest, not the longest: when the user asks for a shorter or changed version, the later
    draft is the final one. A later message that only discusses the draft ("I changed the title")
    is too short or too questioning to count, so the draft before it is kept.
    """
    for message in reversed(messages):
        if message.role != "assistant":
            continue
        body = strip_chatter(message.content)
        if looks_like_document(body):
            return body
    return ""
