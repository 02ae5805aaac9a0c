"""rewards.extract.last_document on hand-made conversations: which assistant message is the document,
and what chatter is taken off it."""

from __future__ import annotations

from parley.protocol.messages import ChatMessage
from parley.rewards.extract import MIN_DOCUMENT_WORDS, last_document, looks_like_document, strip_chatter

DRAFT = (
    "Three Days in Lisbon\n\n"
    "I landed in Lisbon on a gray morning with no plan beyond eating well and walking until my legs gave out. "
    "Day one was Alfama, where the streets twist so much that my map gave up, and a singer performed fado "
    "between courses at dinner."
)
SHORTER = (
    "Three Days in Lisbon\n\n"
    "Lisbon in three days: the winding lanes of Alfama, tram 28 before the crowds, three custard tarts in Belem, "
    "a cold swim in Cascais and a sunset over the whole city from the hill."
)


def conv(*assistant_and_user: str) -> list[ChatMessage]:
    """Alternating user / assistant messages, the user first."""
    roles = ["user", "assistant"]
    return [ChatMessage(roles[i % 2], text) for i, text in enumerate(assistant_and_user)]


def test_the_draft_without_preamble_and_closing_offer():
    messages = conv(
        "can you help me write a blog post about my trip",
        "Sure! Here's a draft of your blog post:\n\n" + DRAFT + "\n\nLet me know if you'd like any changes!",
    )
    assert last_document(messages) == DRAFT


def test_questions_only_is_no_document():
    messages = conv(
        "help me write a post about lisbon",
        "Happy to help! Who will read it, and how long should it be? Should it be funny or serious?",
    )
    assert last_document(messages) == ""


def test_the_newest_draft_wins_over_a_longer_earlier_one():
    messages = conv("write about lisbon", DRAFT + " " + DRAFT, "make it shorter", SHORTER)
    assert last_document(messages) == SHORTER


def test_a_closing_remark_after_the_draft_keeps_the_draft():
    messages = conv(
        "write about lisbon", DRAFT, "thanks", "You're welcome! I changed the title as you asked. Anything else?"
    )
    assert last_document(messages) == DRAFT


def test_a_mostly_questioning_message_is_not_a_document():
    questions = " ".join(f"Question number {i} about the trip, what did you like most about day {i}?" for i in range(4))
    assert len(questions.split()) >= MIN_DOCUMENT_WORDS
    assert not looks_like_document(questions)
    assert last_document(conv("write about lisbon", DRAFT, "hm", questions)) == DRAFT


def test_user_messages_are_never_the_document():
    assert last_document(conv(DRAFT, "What should I change?")) == ""


def test_strip_chatter_keeps_inner_lines_and_markdown_titles():
    text = "Certainly, here is the revised version:\n\n**Three Days in Lisbon**\n\nBody line one.\n\nBody line two.\n\nWould you like a shorter one?"
    assert strip_chatter(text) == "**Three Days in Lisbon**\n\nBody line one.\n\nBody line two."


def test_a_long_line_that_opens_like_chatter_is_content():
    line = "Sure enough, " + "the trams climbed every hill we could find in the old town " * 4
    assert strip_chatter(line) == line.strip()
