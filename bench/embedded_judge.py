"""Which document extractor and interactivity scale carry signal with the embedded judge (issue 18)?

One SmolLM2-135M engine ("smol", the default config's [judge.engine]) plays the assistant for two
turns on the first 6 bundled items, 2 conversations each (a lazy opening request, then the item's
summary as the user's answer; [rollout] max_tokens per reply, temperature 1), then judges every
conversation the way the scorer would: extract by the judge vs rewards.extract.last_document,
sacreBLEU and character BLEU of both against the reference, and interactivity on the rubric and on
the 3-level scale, and the rubric by expected level (`rubric_expected`). Prints one JSON row per
conversation, the share of BLEU > 0 and each interactivity scale's within-pair std. Run by hand:

    PYTHONPATH=. python bench/embedded_judge.py > bench/results/raw/embedded_judge_smol.txt
    PYTHONPATH=. python bench/embedded_judge.py --interactivity-only   # no extraction (faster)

Nothing in parley imports this file. Results and what they decided: docs/rewards.md.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time


async def main() -> None:
    from parley.config.run import load_config
    from parley.engines.backend import LocalBackend, open_engine
    from parley.protocol.messages import ChatMessage
    from parley.rewards.extract import last_document
    from parley.rewards.metrics import bleu, char_bleu
    from parley.services.judge.client import LocalJudge
    from parley.services.judge.server import Judge
    from parley.tasks.data import load_items

    cfg = load_config("deploy/configs/default.toml")
    t0 = time.time()
    engine, tok, _ = open_engine(cfg.judge.engine)
    print(f"# engine up in {time.time() - t0:.0f}s", flush=True)
    backend = LocalBackend(engine, tok, model_name="smol")
    judge = LocalJudge(Judge(backend, cfg.judge))
    items = load_items("bundled")[:6]

    async def reply(messages, seed):
        ids = backend.prompt_ids([{"role": m.role, "content": m.content} for m in messages])
        out = await engine.generate(ids, max_tokens=cfg.rollout.max_tokens, temperature=1.0, seed=seed)
        return out.text.strip()

    async def conversation(item, k):
        msgs = [ChatMessage("user", item.prefix[0].content)]
        msgs.append(ChatMessage("assistant", await reply(msgs, 10 * k)))
        msgs.append(ChatMessage("user", "Here is what I want: " + item.summary))
        msgs.append(ChatMessage("assistant", await reply(msgs, 10 * k + 1)))
        return msgs

    order = [it for it in items for _ in range(2)]
    convs = await asyncio.gather(*(conversation(it, k) for it in items for k in range(2)))
    print(f"# {len(convs)} conversations in {time.time() - t0:.0f}s", flush=True)

    skip_extract = "--interactivity-only" in sys.argv[1:]

    async def no_extract(msgs):
        from parley.protocol.messages import JudgeReply

        return JudgeReply(ok=False, error="not asked (--interactivity-only)")

    async def judged(item, msgs):
        ext, rub, three, expected = await asyncio.gather(
            no_extract(msgs) if skip_extract else judge.ask("extract", msgs),
            judge.ask("interactivity", msgs),
            judge.ask("interactivity_3level", msgs),
            judge.ask("interactivity_expected", msgs),
        )
        det = last_document(msgs)
        return {
            "item": item.item_id,
            "judge_ok": ext.ok,
            "judge_attempts": ext.attempts,
            "judge_doc": ext.document[:120],
            "judge_bleu": bleu(ext.document, item.reference) if ext.ok else None,
            "last_doc_bleu": bleu(det, item.reference),
            "last_doc_words": len(det.split()),
            "judge_char": char_bleu(ext.document, item.reference) if ext.ok else None,
            "last_doc_char": char_bleu(det, item.reference),
            "rubric": rub.score if rub.ok else None,
            "rubric_attempts": rub.attempts,
            "three": three.score if three.ok else None,
            "three_attempts": three.attempts,
            "expected": expected.score if expected.ok else None,
            "expected_attempts": expected.attempts,
            "expected_levels": expected.levels,
            "expected_distribution": expected.distribution,
            "assistant": [m.content[:160] for m in msgs if m.role == "assistant"],
        }

    rows = await asyncio.gather(*(judged(it, c) for it, c in zip(order, convs)))
    for r in rows:
        print(json.dumps(r), flush=True)
    n = len(rows)

    def share(key):
        return sum(1 for r in rows if r[key] is not None and r[key] > 0) / n

    print(
        f"# BLEU>0: judge {share('judge_bleu'):.2f}  last_document {share('last_doc_bleu'):.2f};"
        f" judge failures {sum(not r['judge_ok'] for r in rows)}/{n}; total {time.time() - t0:.0f}s"
    )
    for key in ("rubric", "three", "expected"):  # rows come in pairs: two conversations of one item
        pairs = [(rows[i][key], rows[i + 1][key]) for i in range(0, n, 2)]
        stds = [statistics.pstdev(p) for p in pairs if None not in p]
        print(
            f"# {key}: within-pair std mean {statistics.fmean(stds) if stds else float('nan'):.4f}, "
            f"{sum(s > 1e-3 for s in stds)} of {len(stds)} pairs > 1e-3; failed {sum(r[key] is None for r in rows)}/{n}"
        )
    engine.shutdown()


if __name__ == "__main__":  # vLLM starts workers with spawn: keep the import side-effect free
    asyncio.run(main())
