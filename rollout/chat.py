"""Token-in / token-out bookkeeping for one multi-turn conversation: the exact token ids the
policy saw and produced, which of them are trained, and the readable messages alongside.
Used by rollout.conversation (the loop the actor and the eval run); needs only a HF tokenizer (no vLLM).

Why tokens and not text: re-rendering a conversation through the chat template and
re-tokenizing it does not reproduce what the model generated (BPE merges across turn
boundaries, templates that rewrite earlier assistant turns such as Qwen3 dropping the empty
think block). The learner must score exactly the sampled ids, so we only ever append.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Stand-in texts for the reference history used to measure template deltas. They never reach
# the token stream; the assistant one must be unique so we can find where its turn ends.
_REF_SYSTEM = "reference system"
_REF_USER = "reference user"
_REF_ASSISTANT = "@@parley-reference-assistant@@"


@dataclass
class ChatTokens:
    """One conversation as token ids.

    tokenizer: a HF tokenizer with a chat template.
    messages: the opening messages (system, user, possibly earlier turns); rendered once with
        add_generation_prompt=True and masked out, as soon as they end with a user message
        (otherwise together with the first add_user()).
    template_kwargs: passed to every apply_chat_template call (e.g. enable_thinking=False).
    end_token_ids: the ids that end an assistant turn; default: the tokenizer's eos id plus
        whatever stop tokens appear in the template's own closing text.
    """

    tokenizer: Any
    messages: list[dict[str, str]]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    end_token_ids: Sequence[int] | None = None

    token_ids: list[int] = field(init=False, default_factory=list)
    loss_mask: list[int] = field(init=False, default_factory=list)
    # behaviour log-probs aligned with token_ids (0.0 where loss_mask is 0)
    logprobs: list[float] = field(init=False, default_factory=list)
    # [start, end) of each assistant turn's generated ids within token_ids
    spans: list[tuple[int, int]] = field(init=False, default_factory=list)
    finish_reasons: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        # The fast (Rust) tokenizer directly: transformers' encode/decode wrappers walk every id in
        # Python (to_py_obj) before handing the list over, which cost more than the tokenizing.
        # Its wrapper stays in use where it does more than that (a slow tokenizer, space clean-up).
        fast = getattr(self.tokenizer, "backend_tokenizer", None)
        self._fast = (
            fast if fast is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False) else None
        )
        self.messages = [dict(m) for m in self.messages]
        self._has_system = bool(self.messages) and self.messages[0].get("role") == "system"
        self._close_ids, self._suffix_ids = self._assistant_closing()
        # Nothing has been generated yet, so the opening may be rendered as a whole. If it
        # does not end with a user message (e.g. only a system prompt, and the simulated user
        # speaks first), rendering waits for that first add_user().
        self._awaiting = "user"
        if self.messages and self.messages[-1].get("role") == "user":
            self._open()

    def _open(self) -> None:
        opening = self._render(self.messages, add_generation_prompt=True)
        self._append(self._encode(opening), mask=0)
        self._awaiting = "assistant"

    # -- template probing ---------------------------------------------------------------------

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        # The template writes special tokens (BOS, <|im_start|>...) as text itself.
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _reference(self) -> list[dict[str, str]]:
        # Mirror whether the real conversation has a system message: some templates insert a
        # default one otherwise, and we want the reference to take the same branch.
        ref = [{"role": "system", "content": _REF_SYSTEM}] if self._has_system else []
        return ref + [
            {"role": "user", "content": _REF_USER},
            {"role": "assistant", "content": _REF_ASSISTANT},
        ]

    def _after_reference_assistant(self, rendered: str) -> int:
        """Index just past the reference assistant's content in a rendering."""
        pos = rendered.find(_REF_ASSISTANT)
        if pos < 0:
            raise ValueError("chat template dropped the assistant message content")
        return pos + len(_REF_ASSISTANT)

    def _assistant_closing(self) -> tuple[list[int], list[int]]:
        """Split what the template writes after an assistant's content into the end-of-turn
        part (up to and including the stop token; the model generates it) and the inter-turn
        suffix (e.g. the "\\n" after <|im_end|>; never generated)."""
        rendered = self._render(self._reference(), add_generation_prompt=False)
        after = rendered[self._after_reference_assistant(rendered) :]
        self._closing_text = after
        after_ids = self._encode(after)

        ends = set(self.end_token_ids or ())
        if not ends:
            eos = self.tokenizer.eos_token_id
            ends = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        cut = next((i for i, t in enumerate(after_ids) if t in ends), None)
        if cut is None:
            raise ValueError(
                f"no end-of-turn token {sorted(ends)} in the template's assistant closing {after!r}; pass end_token_ids"
            )
        self.end_token_ids = sorted(ends)
        return after_ids[: cut + 1], after_ids[cut + 1 :]

    def _user_delta(self, text: str) -> list[int]:
        """Tokens the template adds for a new user message after a finished assistant turn,
        including the next generation prompt. Measured on the reference history, so the real
        history is never re-rendered or re-tokenized."""
        ref = self._reference()
        closing_text = self._closing_text
        extended = self._render(ref + [{"role": "user", "content": text}], add_generation_prompt=True)
        # Count from the end of the reference assistant's closing rather than comparing whole
        # prefixes: Qwen3-style templates render the last assistant differently from an
        # earlier one (the think block), so `extended` need not start with `closed`.
        start = self._after_reference_assistant(extended)
        if not extended.startswith(closing_text, start):
            raise ValueError("chat template closes an assistant turn differently when a user follows")
        return self._encode(extended[start + len(closing_text) :])

    # -- appending ----------------------------------------------------------------------------

    def _append(self, ids: Iterable[int], mask: int, logprobs: Iterable[float] | None = None) -> None:
        ids = list(ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(list(logprobs) if logprobs is not None else [0.0] * len(ids))

    def add_assistant(
        self,
        generated_ids: Sequence[int],
        finish_reason: str = "stop",
        logprobs: Sequence[float] | None = None,
    ) -> str:
        """Append exactly the sampled ids (trained). If they do not end with an end-of-turn
        token (max_tokens, a stop string, an abort), close the turn with untrained tokens.
        Returns the assistant's text."""
        if self._awaiting != "assistant":
            raise ValueError("add_assistant needs a conversation that ends with a user turn")
        generated_ids = list(generated_ids)
        if logprobs is not None and len(logprobs) != len(generated_ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(generated_ids)} tokens")
        start = len(self.token_ids)
        self._append(generated_ids, mask=1, logprobs=logprobs)
        self.spans.append((start, len(self.token_ids)))
        self.finish_reasons.append(finish_reason)

        ended = bool(generated_ids) and generated_ids[-1] in self.end_token_ids
        if not ended:
            self._append(self._close_ids, mask=0)
        self._append(self._suffix_ids, mask=0)

        content_ids = generated_ids[:-1] if ended else generated_ids
        # Special tokens the model emitted mid-turn stay in the text (as their literal form), so
        # the messages render back to exactly these ids; dropping them would make the readable
        # conversation disagree with what was trained.
        content = self._decode(content_ids)
        self.messages.append({"role": "assistant", "content": content})
        self._awaiting = "user"
        return content

    def add_user(self, text: str) -> None:
        """Append a user message and the next generation prompt (untrained)."""
        if self._awaiting != "user":
            raise ValueError("add_user needs a conversation that ends with an assistant turn")
        if not self.token_ids:
            # still only the (unrendered) opening: render it together with this message
            self.messages.append({"role": "user", "content": text})
            self._open()
            return
        self._append(self._user_delta(text), mask=0)
        self.messages.append({"role": "user", "content": text})
        self._awaiting = "assistant"

    def fork(self) -> ChatTokens:
        """An independent copy (the tokenizer is shared), e.g. to try a user message."""
        c = copy.copy(self)
        for name in ("token_ids", "loss_mask", "logprobs", "spans", "finish_reasons"):
            setattr(c, name, list(getattr(self, name)))
        c.messages = [dict(m) for m in self.messages]
        return c

    # -- views --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        """What to send to the engine for the next assistant turn."""
        return list(self.token_ids)

    @property
    def num_trained(self) -> int:
        return sum(self.loss_mask)
