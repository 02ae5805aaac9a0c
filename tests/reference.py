"""Test-side references: what the learner side of the log-prob contract computes, with a plain
transformers forward pass (no packing, no DeepSpeed), to check engines and the learner against."""

from __future__ import annotations

from collections.abc import Sequence


def reference_logprobs(
    model, prompt_ids: Sequence[int], gen_ids: Sequence[int], temperature: float = 1.0
) -> list[float]:
    """The learner side of the log-prob contract: log-probs of gen_ids after prompt_ids under a
    transformers causal LM, computed in fp32 (one forward pass): of the raw model, or of the
    distribution sampled at `temperature` (log_softmax(logits / temperature))."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(gen_ids)], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    n = len(prompt_ids)
    # position t predicts token t+1
    pred = torch.log_softmax(logits[n - 1 : n - 1 + len(gen_ids)] / temperature, dim=-1)
    target = torch.tensor(list(gen_ids), dtype=torch.long, device=device)
    return pred.gather(1, target[:, None])[:, 0].tolist()
