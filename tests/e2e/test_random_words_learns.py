"""random_words is learnable from random weights: a toy random Qwen3 with a word-level tokenizer
(bench.common.random_qwen3's scheme, "t<id>" one token each, at a small vocabulary) raises its low_share
under a few GRPO steps of the real learner (Trainer on DeepSpeed, CPU, gloo: the real loss, group
advantages, packing), sampling from itself, the environment's own reward scoring the decoded text. The
default threshold (0.5) learns; what it takes is a learning rate that moves the random weights (here
2e-2; docs/environments.md, "Learnable from random weights"). With the advantages' sign flipped the
same run does not rise, so the test fails if the learning signal is lost."""

from __future__ import annotations

import pytest
import torch

from parley.config.learner import LearnerConfig
from parley.environments.base import Conversation
from parley.environments.random_words import environment
from parley.learner.grpo import group_advantages
from parley.learner.packing import Sample
from parley.learner.trainer import Trainer
from parley.protocol.messages import ChatMessage

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

VOCAB = 256  # "t0".."t249" and six named ids at the top, as random_qwen3's 151,936
NAMED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant")
PROMPT, NEW = 8, 64  # prompt and sampled tokens per sequence
GROUPS, N = 2, 8
THRESHOLD = 0.5  # the default: half the words are low
STEPS = 8


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    """A random 2-layer Qwen3 of bench.common's "mini" shape with tied embeddings and the word-level
    tokenizer scheme of random_qwen3 at VOCAB ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from bench.common import QWEN3_SHAPES, WORD_CHAT_TEMPLATE

    out = tmp_path_factory.mktemp("word_model")
    first_named = VOCAB - len(NAMED)
    vocab = {**{f"t{i}": i for i in range(first_named)}, **{w: first_named + k for k, w in enumerate(NAMED)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="t0",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=WORD_CHAT_TEMPLATE,
    ).save_pretrained(out)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
        **QWEN3_SHAPES["mini"],
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def sample(model, prompts: list[list[int]], gen: torch.Generator):
    """N samples of NEW words per prompt from the model itself (temperature 1, a KV cache), never a named
    id (a random model over 151,936 ids almost never samples its end of turn): the behaviour log-probs."""
    ids = torch.tensor([p for p in prompts for _ in range(N)])  # (G * N, PROMPT)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[: VOCAB - len(NAMED)] = True
    new, lps = [], []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(NEW):
            logp = torch.log_softmax(out.logits[:, -1].float().masked_fill(~allowed, float("-inf")), dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)  # (G * N, 1)
            new.append(nxt)
            lps.append(logp.gather(1, nxt)[:, 0])
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat([ids, *new], dim=1), torch.stack(lps, dim=1)  # (G * N, PROMPT + NEW), (G * N, NEW)


def train(word_model, threshold: float, sign: float = 1.0) -> list[float]:
    """Each step's mean low_share over its GROUPS x N samples, before that step trains on them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_model)
    env = environment(n_items=4, threshold=threshold)
    trainer = Trainer(LearnerConfig(zero_stage=2, lr=2e-2, kl_coef=0.0, micro_batch_tokens=4096), word_model)
    gen = torch.Generator().manual_seed(0)
    history = []
    for _ in range(STEPS):
        prompts = [torch.randint(0, VOCAB - len(NAMED), (PROMPT,), generator=gen).tolist() for _ in range(GROUPS)]
        trainer.engine.eval()
        ids, lps = sample(trainer.module, prompts, gen)
        rewards = torch.tensor(
            [
                env.reward.evaluate(
                    Conversation(
                        [
                            ChatMessage("user", tok.decode(row[:PROMPT])),
                            ChatMessage("assistant", tok.decode(row[PROMPT:])),
                        ]
                    )
                )["low_share"]
                for row in ids.tolist()
            ]
        ).reshape(GROUPS, N)
        history.append(float(rewards.mean()))
        print(f"step {len(history)}: low_share {history[-1]:.3f}", flush=True)
        adv = sign * group_advantages(rewards).reshape(-1)
        trainer.train_step(
            [
                Sample(
                    f"s{i}", ids[i].tolist(), [0] * PROMPT + [1] * NEW, [0.0] * PROMPT + lps[i].tolist(), float(adv[i])
                )
                for i in range(ids.shape[0])
            ]
        )
    return history


@pytest.fixture
def one_thread():
    """One intra-op thread: the sampling loop's many small ops spin-wait for a second thread on a shared
    2-core machine (7x slower measured beside other tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_low_share_rises_under_a_few_grpo_steps(word_model, one_thread):
    history = train(word_model, THRESHOLD)
    start, end = sum(history[:2]) / 2, sum(history[-2:]) / 2
    # random text scores about 0.5 with a spread of 0.5 / sqrt(64) = 0.06 a sample, 0.02 over a step's 16
    assert end > start + 0.15, f"low_share did not rise: {start:.3f} -> {end:.3f} ({history})"
