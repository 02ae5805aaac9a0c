"""ChatTokens against the toy tokenizer: the token stream must read back as the chat template's
own rendering (ChatML) or as what a Qwen3 model actually sees with thinking off, and the loss
mask must cover exactly the sampled ids."""

from __future__ import annotations

import pytest

from parley.engines.models import ensure_model
from parley.rollout.chat import ChatTokens

# Written to behave like Qwen3's template with thinking off: the generation prompt carries an
# empty think block, the last assistant turn after the last user message keeps it, earlier
# assistant turns are rendered without it.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # through ensure_model, so the cache path is exercised too (a private cache, not ~/.cache)
    mp = pytest.MonkeyPatch()
    mp.setenv("PARLEY_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        yield ensure_model("tiny")
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def tok(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def test_ensure_model_resolution(tiny_path, tmp_path):
    assert (tiny_path / "config.json").is_file() and (tiny_path / "model.safetensors").is_file()
    assert ensure_model(str(tmp_path)) == tmp_path  # an existing directory passes through
    with pytest.raises(ValueError, match="'no-such-model'.*tiny, smol"):
        ensure_model("no-such-model")


@pytest.fixture
def qwen_tok(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = QWEN3_LIKE
    return t


def render(tok, messages, gen=False, **kw):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def assert_mask_matches_spans(chat, generated):
    assert len(chat.loss_mask) == len(chat.token_ids) == len(chat.logprobs)
    expected = [0] * len(chat.token_ids)
    for (a, b), gen in zip(chat.spans, generated, strict=True):
        assert chat.token_ids[a:b] == list(gen)
        expected[a:b] = [1] * (b - a)
    assert chat.loss_mask == expected
    assert sum(chat.loss_mask) == sum(len(g) for g in generated)


def test_chatml_multi_turn_matches_template(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    opening = [
        {"role": "system", "content": "You help people write."},
        {"role": "user", "content": "Write a title for my story."},
    ]
    chat = ChatTokens(tok, opening)
    assert chat.token_ids == enc(tok, render(tok, opening, gen=True))
    assert chat.end_token_ids == [end]
    assert chat.loss_mask == [0] * len(chat.token_ids)

    gen1 = enc(tok, "The Letter in the Radio") + [end]  # ended with its end-of-turn token
    assert chat.add_assistant(gen1, "stop") == "The Letter in the Radio"
    chat.add_user("Make it shorter, please.")
    gen2 = enc(tok, "The Old Radio and the")  # cut by max_tokens: no end token
    chat.add_assistant(gen2, "length")

    expected = render(tok, chat.messages)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[-1]["content"] == "The Old Radio and the"
    assert tok.decode(chat.token_ids) == expected
    # the generated ids here are the canonical tokenization, so the whole stream is too
    assert chat.token_ids == enc(tok, expected)
    assert_mask_matches_spans(chat, [gen1, gen2])
    # the untrained closing of the truncated turn: <|im_end|> then "\n"
    b = chat.spans[1][1]
    assert tok.decode(chat.token_ids[b:]) == "<|im_end|>\n"

    probe = chat.fork()
    probe.add_user("Thanks!")
    assert tok.decode(probe.token_ids) == render(tok, probe.messages, gen=True)
    # the original is untouched and can still take a different user message
    assert len(chat.messages) == 5 and chat.token_ids == enc(tok, expected)
    chat.add_user("Thanks a lot!")
    assert tok.decode(chat.token_ids) == render(tok, chat.messages, gen=True)


def test_generated_ids_are_kept_verbatim(tok):
    """Non-canonical ids (one token per character) must survive untouched, with their
    log-probs aligned."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = ChatTokens(tok, [{"role": "user", "content": "Say hello."}])
    gen = [t for ch in "hello there" for t in enc(tok, ch)] + [end]
    assert gen[:-1] != enc(tok, "hello there")
    lps = [-0.5 - i for i in range(len(gen))]
    chat.add_assistant(gen, "stop", logprobs=lps)
    a, b = chat.spans[0]
    assert chat.token_ids[a:b] == gen
    assert chat.logprobs[a:b] == lps
    assert all(lp == 0.0 for i, lp in enumerate(chat.logprobs) if not a <= i < b)
    assert chat.messages[-1]["content"] == "hello there"
    assert tok.decode(chat.token_ids) == render(tok, chat.messages)
    assert_mask_matches_spans(chat, [gen])


def test_opening_without_user_waits_for_first_user(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = ChatTokens(tok, [{"role": "system", "content": "Be brief."}])
    assert chat.token_ids == []
    with pytest.raises(ValueError):
        chat.add_assistant([end])
    chat.add_user("Hi")
    assert chat.token_ids == enc(tok, render(tok, chat.messages, gen=True))
    chat.add_assistant(enc(tok, "Hello") + [end])
    with pytest.raises(ValueError):
        chat.add_assistant([end])
    assert tok.decode(chat.token_ids) == render(tok, chat.messages)


def test_empty_generation_is_closed(tok):
    chat = ChatTokens(tok, [{"role": "user", "content": "Hi"}])
    chat.add_assistant([], "abort")
    assert chat.spans == [(len(chat.token_ids) - 2, len(chat.token_ids) - 2)]
    assert chat.num_trained == 0
    assert tok.decode(chat.token_ids) == render(tok, chat.messages)


def test_qwen3_style_thinking_off(qwen_tok):
    tok = qwen_tok
    end = tok.convert_tokens_to_ids("<|im_end|>")
    kw = {"enable_thinking": False}
    opening = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]
    chat = ChatTokens(tok, opening, template_kwargs=kw)
    assert tok.decode(chat.token_ids) == render(tok, opening, gen=True, **kw)

    gen1 = enc(tok, "A1") + [end]
    chat.add_assistant(gen1)
    chat.add_user("U2")
    gen2 = enc(tok, "A2 is long")
    chat.add_assistant(gen2, "length")

    # What the model saw: every assistant turn opened with the empty think block, even though
    # re-rendering the finished conversation drops it from the first turn.
    think = "<think>\n\n</think>\n\n"
    assert tok.decode(chat.token_ids) == (
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\nU1<|im_end|>\n"
        f"<|im_start|>assistant\n{think}A1<|im_end|>\n"
        "<|im_start|>user\nU2<|im_end|>\n"
        f"<|im_start|>assistant\n{think}A2 is long<|im_end|>\n"
    )
    assert render(tok, chat.messages, **kw) != tok.decode(chat.token_ids)
    assert [m["content"] for m in chat.messages if m["role"] == "assistant"] == ["A1", "A2 is long"]
    assert_mask_matches_spans(chat, [gen1, gen2])


def _refuse(*args, **kwargs):
    raise AssertionError("ChatTokens went through the tokenizer's Python encode/decode wrapper")


def test_fast_tokenizer_is_used_directly(tok, monkeypatch):
    """transformers' encode/decode wrappers walk every id in Python before the Rust tokenizer sees
    them; with a fast tokenizer ChatTokens goes around them, and its ids and texts stay the same."""
    import copy

    fast = copy.deepcopy(tok)
    monkeypatch.setattr(fast, "decode", _refuse)
    monkeypatch.setattr(fast, "encode", _refuse)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    special = tok.convert_tokens_to_ids("<|im_start|>")
    chat = ChatTokens(fast, [{"role": "user", "content": "Write a title."}])
    gen = enc(tok, "The Letter") + [special] + enc(tok, " in the Radio") + [end]
    assert chat.add_assistant(gen, "stop") == tok.decode(gen[:-1], skip_special_tokens=False)
    chat.add_user("Shorter, please.")
    assert chat.token_ids == enc(tok, render(tok, chat.messages, gen=True))


def test_tokenizer_with_space_clean_up_keeps_its_wrapper(tok):
    import copy

    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    calls = []
    wrapped = cleaning.decode
    cleaning.decode = lambda ids, **kw: calls.append(ids) or wrapped(ids, **kw)
    chat = ChatTokens(cleaning, [{"role": "user", "content": "Write a title."}])
    gen = enc(tok, "The Letter") + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert chat.add_assistant(gen, "stop") == "The Letter" and calls == [gen[:-1]]
