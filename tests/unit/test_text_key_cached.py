"""tasks.data.text_key is computed once per text: Item.reference_key is read several times per item
(dedupe, split, the leakage check), and with megabyte documents each normalization took a fifth of a
second (the learner's split of 60 such items kept its event loop a minute, past its lease's TTL)."""

from __future__ import annotations

import uuid

from parley.tasks import data


def test_each_reference_is_normalized_once_however_often_its_key_is_read(monkeypatch):
    calls = []
    real = data.re.sub

    def counting_sub(pattern, repl, text, *a, **k):
        calls.append(text)
        return real(pattern, repl, text, *a, **k)

    monkeypatch.setattr(data.re, "sub", counting_sub)
    tag = uuid.uuid4().hex  # texts no earlier test has keyed
    items = [
        data.Item(item_id=f"c{i}/0", prefix=(), reference=f"Document {i % 5} of {tag}.", single_turn_prompt=f"p{i}")
        for i in range(10)
    ]
    train, held = data.split_items(data.dedupe_by_reference(items), 0.4, seed=1)
    assert len(train) + len(held) == 5
    for it in items:
        assert it.reference_key == data.text_key(it.reference)
    references = [t for t in calls if tag in t]
    assert len(references) == 5  # one per distinct document
