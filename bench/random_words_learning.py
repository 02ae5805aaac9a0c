"""Does random_words's low_share climb from random weights under a few GRPO steps, and what sets how
fast (docs/environments.md, "Learnable from random weights")? A random 2-layer Qwen3 (hidden --hidden,
tied embeddings scaled by --escale so its logits spread about as a random Qwen3-4B's, 0.02 x
sqrt(2560)) over the word ids "t0".."t<vocab-7>" samples from itself (a KV cache, temperature 1, no
named id); the environment's reward scores the words ("crc", the environment's own; "range": an id
below threshold x vocab instead of the hash); the real learner (learner.trainer.Trainer on DeepSpeed,
CPU) trains each step's groups. Prints each step's mean reward, then the run as JSON.

    python bench/random_words_learning.py --threshold 0.5 --lr 1e-2          # learns by step 15
    python bench/random_words_learning.py --threshold 0.5 --lr 4e-4          # flat (the 4B's 1e-5, scaled)

About 5 s a step on 2 cores (one torch thread). Nothing in parley imports this file.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parley.config.learner import LearnerConfig, LoraSettings  # noqa: E402
from parley.environments.base import Conversation  # noqa: E402
from parley.environments.random_words import environment  # noqa: E402
from parley.learner.grpo import group_advantages  # noqa: E402
from parley.learner.packing import Sample  # noqa: E402
from parley.learner.trainer import Trainer  # noqa: E402
from parley.protocol.messages import ChatMessage  # noqa: E402

PROMPT = 16  # random prompt words a sample
NAMED = 6  # the top ids: the chat tokens and role names of random_qwen3's tokenizer, never sampled


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=4096, help="ids, the named ones included")
    p.add_argument("--tokens", type=int, default=128, help="sampled words a sample")
    p.add_argument("--groups", type=int, default=2, help="groups a step")
    p.add_argument("--n", type=int, default=8, help="samples a group")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--threshold", type=float, default=0.5, help="[env] options.threshold")
    p.add_argument("--low", choices=("crc", "range"), default="crc", help="which words are low")
    p.add_argument("--lora", action="store_true", help="a rank-16 LoRA adapter instead of full fine-tuning")
    p.add_argument("--flip", action="store_true", help="the advantages' sign flipped (must not learn)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--escale", type=float, default=4.0, help="the random embeddings' scale")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(a, out: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=a.vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1e6,
        bos_token_id=None,
        eos_token_id=a.vocab - 1,
        pad_token_id=a.vocab - 2,
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    torch.manual_seed(a.seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(a.escale)
    model.save_pretrained(out)
    return out


def sample(a, model, prompts, gen):
    """a.n samples of a.tokens words per prompt and their behaviour log-probs."""
    ids = torch.tensor([q for q in prompts for _ in range(a.n)])  # (G * n, PROMPT)
    new, lps = [], []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(a.tokens):
            logits = out.logits[:, -1].float()
            logits[:, a.vocab - NAMED :] = float("-inf")  # every turn runs to its length, as on a random 4B
            logp = torch.log_softmax(logits, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            new.append(nxt)
            lps.append(logp.gather(1, nxt)[:, 0])
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat([ids, *new], 1), torch.stack(lps, 1)


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(1)  # the sampling loop's small ops spin-wait for a second thread on 2 shared cores
    out = Path(tempfile.gettempdir()) / f"random_words_learning_{a.vocab}_{a.hidden}_{a.seed}_{a.escale}"
    if not (out / "config.json").exists():
        build(a, out)
    env = environment(n_items=10, threshold=a.threshold)

    def reward(ids: list[int]) -> float:
        if a.low == "range":
            return sum(i < a.threshold * a.vocab for i in ids) / len(ids)
        words = " ".join(f"t{i}" for i in ids)
        conv = Conversation([ChatMessage("user", "t1"), ChatMessage("assistant", words)])
        return env.reward.evaluate(conv)["low_share"]

    lora = LoraSettings(enabled=True, rank=16, alpha=32.0) if a.lora else LoraSettings()
    trainer = Trainer(LearnerConfig(zero_stage=2, lr=a.lr, kl_coef=0.0, micro_batch_tokens=8192, lora=lora), out)
    gen = torch.Generator().manual_seed(a.seed)
    history = []
    for step in range(a.steps):
        t0 = time.time()
        prompts = [torch.randint(0, a.vocab - NAMED, (PROMPT,), generator=gen).tolist() for _ in range(a.groups)]
        trainer.engine.eval()
        ids, lps = sample(a, trainer.module, prompts, gen)
        r = torch.tensor([reward(row[PROMPT:].tolist()) for row in ids]).reshape(a.groups, a.n)
        adv = group_advantages(r).reshape(-1) * (-1 if a.flip else 1)
        samples = [
            Sample(
                f"s{i}", ids[i].tolist(), [0] * PROMPT + [1] * a.tokens, [0.0] * PROMPT + lps[i].tolist(), float(adv[i])
            )
            for i in range(ids.shape[0])
        ]
        st = trainer.train_step(samples)
        history.append(float(r.mean()))
        print(
            f"step {step} reward {r.mean():.4f} group_std {r.std(dim=1).mean():.4f} "
            f"entropy {st.get('entropy', 0):.3f} {time.time() - t0:.1f}s",
            flush=True,
        )
    print(json.dumps({**vars(a), "history": [round(h, 4) for h in history]}))


if __name__ == "__main__":
    main()
