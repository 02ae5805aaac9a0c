"""bench.common.random_qwen3 gives a checkpoint `parley up` accepts: its word-level tokenizer covers
every id, has a chat template that open_engine's check passes, renders a conversation that decodes
back to exactly its text, and ends an assistant turn with eos (<|im_end|>); rollout.chat.ChatTokens
appends turns to the same ids as the whole conversation rendered at once. Built at the "mini" shape
(seconds on a CPU); no engine is started."""

from __future__ import annotations

import json
import random

import pytest

from bench.common import QWEN3_EOS, QWEN3_IM_START, QWEN3_NAMED, QWEN3_PAD, QWEN3_VOCAB, random_qwen3
from parley.engines.backend import chat_tokenizer
from parley.rollout.chat import ChatTokens


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    return random_qwen3("mini", tmp_path_factory.mktemp("models") / "mini")


@pytest.fixture(scope="module")
def tok(mini):
    return chat_tokenizer(str(mini), mini)  # open_engine's check, without an engine


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(QWEN3_PAD) for _ in range(n)]  # ids below the named ones: "t<id>"


def test_the_tokenizer_covers_every_id_and_ends_a_turn_with_eos(mini, tok):
    config = json.loads((mini / "config.json").read_text())
    assert config["vocab_size"] == QWEN3_VOCAB == len(tok) and config["eos_token_id"] == QWEN3_EOS
    assert json.loads((mini / "generation_config.json").read_text())["eos_token_id"] == QWEN3_EOS
    tokens = tok.convert_ids_to_tokens(list(range(QWEN3_VOCAB)))
    assert len(set(tokens)) == QWEN3_VOCAB and tokens[7] == "t7" and tokens[-1] == f"t{QWEN3_VOCAB - 1}"
    assert {i: tokens[i] for i in QWEN3_NAMED} == QWEN3_NAMED
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", QWEN3_EOS, QWEN3_PAD)
    assert {QWEN3_PAD, QWEN3_IM_START, QWEN3_EOS} <= set(tok.all_special_ids)
    # special tokens split out of running text, as vLLM's detokenized output may hold them
    assert tok.encode("t5<|im_end|>t6", add_special_tokens=False) == [5, QWEN3_EOS, 6]


def test_a_rendered_conversation_round_trips(tok):
    msgs = [
        {"role": "system", "content": "t1 t2"},
        {"role": "user", "content": "t5 t6 t151935"},
        {"role": "assistant", "content": "t9 <|im_start|> t10"},
        {"role": "user", "content": "t7"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|> system t1 t2 <|im_end|> <|im_start|> user t5 t6 t151935 <|im_end|> "
        "<|im_start|> assistant t9 <|im_start|> t10 <|im_end|> <|im_start|> user t7 <|im_end|> "
        "<|im_start|> assistant"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:7] == [QWEN3_IM_START, 151646, 1, 2, QWEN3_EOS, QWEN3_IM_START, 151647]
    assert tok.decode(ids) == text and tok.encode(tok.decode(ids), add_special_tokens=False) == ids


def test_chat_tokens_appends_the_ids_of_the_whole_rendered_conversation(tok):
    rng = random.Random(0)
    chat = ChatTokens(tok, [{"role": "system", "content": "t3"}, {"role": "user", "content": "t1 t2"}])
    assert chat.end_token_ids == [QWEN3_EOS]
    chat.add_assistant(words(rng, 5) + [QWEN3_EOS])  # a turn the model ended
    chat.add_user(" ".join(f"t{i}" for i in words(rng, 4)))
    chat.add_assistant(words(rng, 6), finish_reason="length")  # cut at max_tokens: closed untrained
    whole = tok.apply_chat_template(chat.messages, tokenize=False)
    assert chat.token_ids == tok.encode(whole, add_special_tokens=False)
    assert chat.num_trained == 5 + 1 + 6


def test_weights_are_kept_and_an_old_tokenizer_gets_the_template(mini):
    weights = next(mini.glob("*.safetensors"))
    stamp = weights.stat().st_mtime_ns
    (mini / "chat_template.jinja").unlink()  # as a checkpoint built before the chat template
    assert random_qwen3("mini", mini) == mini
    assert weights.stat().st_mtime_ns == stamp and (mini / "chat_template.jinja").is_file()
    chat_tokenizer(str(mini), mini)
