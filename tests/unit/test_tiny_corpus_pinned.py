"""tiny's tokenizer is trained on the bundled data's first 60 records (engines.models.TINY_CORPUS_RECORDS):
records added to tasks/datasets/medium.jsonl later must not change tiny, or every cached checkpoint,
CPU figure and test outcome made with it silently changes (when the file grew from 60 to 150 records,
a judge test's tiny extract replies turned into unterminated JSON)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from parley.engines.models import TINY_CORPUS_RECORDS, _corpus_texts, _train_tokenizer
from parley.tasks.data import bundled_path

# sha256 of tiny's vocabulary (sorted (token, id) pairs as JSON) as built from the 60-record file
TINY_VOCAB_SHA256 = "0090785d21411b35898b529189533a203522fc55a7859a3b480b1bb5cca84658"


def test_tiny_vocabulary_is_the_one_built_from_the_first_60_records():
    assert TINY_CORPUS_RECORDS == 60
    tok = _train_tokenizer(_corpus_texts(Path(bundled_path()), max_records=TINY_CORPUS_RECORDS), 2048)
    vocab = json.dumps(sorted(tok.get_vocab().items()))
    assert hashlib.sha256(vocab.encode()).hexdigest() == TINY_VOCAB_SHA256


def test_the_record_limit_reads_only_the_first_records(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"record{i}"}) + "\n" for i in range(5)))
    texts = _corpus_texts(path, max_records=2)
    assert "record0" in texts and "record1" in texts and "record2" not in texts
    assert "record4" in _corpus_texts(path)
