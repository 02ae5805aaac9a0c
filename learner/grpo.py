"""GRPO objective as pure tensor functions: group advantages, clipped policy loss with
dual clip against the behaviour policy, k3 KL, and loss aggregation over packed
sequences. Called by the learner's train step; holds no model and no optimizer state.

Packed layout: every per-token tensor is 1-D (T,), the tokens of several sequences
concatenated without padding; `seq_ids` (T,) (or a list of lengths) says which
sequence each token belongs to, and `mask` (T,) marks the tokens that are trained
on (assistant tokens), so prompt/user tokens can stay in the pack.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from parley.config.learner import LOSS_AGG, LearnerConfig
from parley.learner.groups import Taken, behaviour_logprobs
from parley.learner.packing import PackedBatch, Sample
from parley.protocol import arrays

# exp() of a log-ratio beyond this overflows float32 or turns 0 * inf into NaN;
# tokens that far off-policy are clipped anyway, so bounding them loses nothing useful.
_MAX_LOG_RATIO = 20.0


def group_advantages(rewards: Tensor, scale: bool = True, eps: float = 1e-6, std: str = "sample") -> Tensor:
    """Group-relative advantages for rewards (G, n): G prompts, n samples each.

    scale=True: (r - mean) / (std + eps); scale=False: r - mean (the "no-std"
    option, which keeps reward units and does not blow up near-flat groups).

    std="sample" divides by the sample standard deviation (n - 1 in its denominator), as verl's and
    TRL's GRPO do; std="population" by the population one (n), which makes every advantage
    sqrt(n / (n - 1)) larger (1.07x at n = 8, 1.15x at n = 4). A group of one sample has advantage 0
    either way (its sample std is undefined).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (G, n), got shape {tuple(rewards.shape)}")
    if std not in ("sample", "population"):
        raise ValueError(f"std={std!r}: use 'sample' (n - 1) or 'population' (n)")
    mean = rewards.mean(dim=1, keepdim=True)  # (G, 1)
    centred = rewards - mean  # (G, n)
    if not scale:
        return centred
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    spread = rewards.std(dim=1, correction=1 if std == "sample" else 0, keepdim=True)  # (G, 1)
    return centred / (spread + eps)


def _check_tokens(**tensors: Tensor | None) -> int:
    lengths = {}
    for name, t in tensors.items():
        if t is None:
            continue
        if t.dim() != 1:
            raise ValueError(f"{name} must be a packed 1-D (T,) tensor, got shape {tuple(t.shape)}")
        lengths[name] = t.shape[0]
    if len(set(lengths.values())) > 1:
        raise ValueError(f"packed tensors disagree on T: {lengths}")
    return next(iter(lengths.values()), 0)


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    n = int(mask.sum())
    if n == 0:
        return 0.0
    return float(torch.where(mask, x, torch.zeros_like(x)).sum() / n)


def _masked_max(x: Tensor, mask: Tensor) -> float:
    if not bool(mask.any()):
        return 0.0
    return float(x[mask].max())


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate per token, with dual clip for negative advantages.

    r = exp(logp - old_logp), all (T,).
      loss = max(-r * A, -clip(r, 1 - clip_low, 1 + clip_high) * A)
    and, for A < 0 with dual_clip = c:
      loss = min(loss, -c * A)
    which bounds the loss (and zeroes its gradient) when a bad token's ratio has
    grown past c. Asymmetric clip_high > clip_low ("clip higher") lets
    low-probability tokens with A > 0 grow further.

    Returns the per-token loss (T,), zero outside `mask`, and stats:
    clip_frac (share of masked tokens where the clipped branch is active),
    dual_clip_frac, ratio_mean, ratio_max (over masked tokens).
    """
    _check_tokens(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    mask = mask.bool()

    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (T,)
    ratio = torch.exp(log_ratio)  # (T,)
    unclipped = -advantages * ratio  # (T,)
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (T,)
    loss = torch.maximum(unclipped, clipped)  # (T,)
    clip_active = clipped > unclipped  # (T,)

    dual_active = torch.zeros_like(mask)
    if dual_clip is not None:
        cap = -dual_clip * advantages  # (T,) positive where A < 0
        negative = advantages < 0
        dual_active = negative & (loss > cap)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)

    loss = torch.where(mask, loss, torch.zeros_like(loss))
    stats = {
        "clip_frac": _masked_mean(clip_active.to(loss.dtype), mask),
        "dual_clip_frac": _masked_mean(dual_active.to(loss.dtype), mask),
        "ratio_mean": _masked_mean(ratio.detach(), mask),
        "ratio_max": _masked_max(ratio.detach(), mask),
    }
    return loss, stats


def truncated_is_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    is_cap: float = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """Policy gradient with a truncated importance weight against the behaviour policy, per token:

      w = min(exp(logp_d - mu), is_cap)     (logp_d = logp detached: the learner's pre-step policy)
      loss = -A * w * exp(logp - logp_d)    (value -A * w; gradient -A * w * d logp)

    With one optimizer step per batch the learner's pre-step policy is the proximal one, so the PPO
    ratio against it is 1 and a clip there never binds; what corrects for the actor's lag and for
    vLLM's numerics is the weight w alone, capped so one far-off token cannot dominate ("truncated IS",
    TIS; TRL's GRPOTrainer with vllm_importance_sampling_mode = "token_truncate" computes the same).
    Against policy_loss this keeps the gradient of tokens whose behaviour ratio left the clip range
    (down-weighted only when past the cap), which the clip zeroes.

    Returns the per-token loss (T,), zero outside `mask`, and stats: is_weight_mean, is_cap_frac
    (share of masked tokens at the cap), ratio_mean and ratio_max (exp(logp - mu), as policy_loss
    reports them), clip_frac and dual_clip_frac (0: nothing is clipped).
    """
    _check_tokens(logp=logp, old_logp=behaviour_logp, advantages=advantages, mask=mask)
    if not is_cap >= 1.0:
        raise ValueError(f"is_cap must be >= 1, got {is_cap}")
    mask = mask.bool()
    current = logp.detach()
    ratio = torch.exp((current - behaviour_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # (T,)
    weight = ratio.clamp(max=is_cap)  # (T,)
    loss = -advantages * weight * torch.exp(logp - current)  # (T,)
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    stats = {
        "clip_frac": 0.0,
        "dual_clip_frac": 0.0,
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_max": _masked_max(ratio, mask),
        "is_weight_mean": _masked_mean(weight, mask),
        "is_cap_frac": _masked_mean((ratio > is_cap).to(loss.dtype), mask),
    }
    return loss, stats


# The per-token k3 value is bounded as verl's low_var_kl bounds it. Without it one token the reference
# finds far likelier than the policy (d = 20 after the log-ratio clamp) gives exp(20) ~ 4.9e8: at
# kl_coef 0.001 that is 5e5 in the loss, dominating every other token, and the gradient norm with it.
_MAX_KL = 10.0


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(policy || ref) per token: exp(d) - d - 1 with d = ref - logp, as verl's
    low_var_kl: d clamped to [-20, 20] first, then the value to [-10, 10].

    Non-negative, zero when the two agree, and lower variance than log-ratio k1. A token whose
    value reaches the bound gets no KL gradient (the clamp is flat there), as in verl.
    """
    _check_tokens(logp=logp, ref_logp=ref_logp)
    d = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (T,)
    return (torch.exp(d) - d - 1.0).clamp(-_MAX_KL, _MAX_KL)


def _seq_index(seq_ids: Tensor | Sequence[int], n_tokens: int, device: torch.device) -> tuple[Tensor, int]:
    """(index (T,) in 0..S-1, S) from per-token sequence ids or a list of lengths."""
    if isinstance(seq_ids, Tensor):
        if seq_ids.dim() != 1 or seq_ids.shape[0] != n_tokens:
            raise ValueError(f"seq_ids must be ({n_tokens},), got shape {tuple(seq_ids.shape)}")
        unique, index = torch.unique(seq_ids, return_inverse=True)
        return index.to(device), int(unique.numel())
    lengths = [int(n) for n in seq_ids]
    if any(n < 0 for n in lengths) or sum(lengths) != n_tokens:
        raise ValueError(f"sequence lengths {lengths} must be >= 0 and sum to T={n_tokens}")
    index = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    return index, len(lengths)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    seq_ids: Tensor | Sequence[int],
    mode: str,
) -> Tensor:
    """Reduce a per-token quantity (T,) over masked tokens to a scalar.

    token-mean:          sum over all masked tokens / number of masked tokens
                         (long sequences weigh more).
    seq-mean-token-sum:  per sequence, sum over its masked tokens; mean over sequences.
    seq-mean-token-mean: per sequence, mean over its masked tokens; mean over sequences
                         (every sequence weighs the same).
    The seq-mean modes average over sequences with at least one masked token: a
    sequence with none has no loss and would only dilute the mean.
    No masked token at all gives a zero that keeps the graph.
    """
    if mode not in LOSS_AGG:
        raise ValueError(f"unknown aggregation mode {mode!r}; allowed: {list(LOSS_AGG)}")
    n_tokens = _check_tokens(per_token=per_token, mask=mask)
    mask = mask.bool()
    values = torch.where(mask, per_token, torch.zeros_like(per_token))  # (T,)
    n_valid = mask.sum()
    if int(n_valid) == 0:
        return values.sum()

    if mode == "token-mean":
        return values.sum() / n_valid

    index, n_seq = _seq_index(seq_ids, n_tokens, per_token.device)
    seq_sum = values.new_zeros(n_seq).index_add(0, index, values)  # (S,)
    seq_count = values.new_zeros(n_seq).index_add(0, index, mask.to(values.dtype))  # (S,)
    has_tokens = seq_count > 0  # (S,)
    if mode == "seq-mean-token-sum":
        return seq_sum[has_tokens].mean()
    return (seq_sum[has_tokens] / seq_count[has_tokens]).mean()


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_ids: Tensor | Sequence[int],
    *,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    agg_mode: str = "token-mean",
    correction: str = "clip",
    is_cap: float = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """loss = aggregate(pg_loss + kl_coef * kl) over a packed batch.

    All per-token inputs are (T,). `advantages` is already broadcast to tokens
    (each token carries its sequence's advantage). `old_logp` is the policy the
    ratio is taken against: in the learner, the behaviour log-probs the actor
    recorded (batch_loss). `ref_logp` is needed when kl_coef > 0; if given with
    kl_coef == 0 the KL is still reported. `correction` says how the lag behind old_logp is
    handled: "clip" (policy_loss: the clipped ratio, with dual clip) or "truncated_is"
    (truncated_is_loss: the ratio as a weight capped at is_cap, no clip).

    Returns (scalar loss, stats): pg_loss, kl_mean, clip_frac, dual_clip_frac,
    ratio_mean, ratio_max (masked-token statistics).
    """
    if agg_mode not in LOSS_AGG:
        raise ValueError(f"unknown aggregation mode {agg_mode!r}; allowed: {list(LOSS_AGG)}")
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp")
    _check_tokens(
        logp=logp,
        old_logp=old_logp,
        advantages=advantages,
        mask=mask,
        ref_logp=ref_logp,
    )
    mask = mask.bool()

    if correction == "clip":
        pg, stats = policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip)  # (T,)
    elif correction == "truncated_is":
        pg, stats = truncated_is_loss(logp, old_logp, advantages, mask, is_cap)  # (T,)
    else:
        raise ValueError(f"unknown behaviour correction {correction!r}; allowed: 'clip', 'truncated_is'")
    per_token = pg  # (T,)

    kl = torch.zeros_like(pg) if ref_logp is None else kl_k3(logp, ref_logp)  # (T,)
    if kl_coef != 0.0:
        per_token = per_token + kl_coef * kl

    loss = aggregate(per_token, mask, seq_ids, agg_mode)
    stats.update(
        pg_loss=float(aggregate(pg.detach(), mask, seq_ids, agg_mode)),
        kl_mean=_masked_mean(kl.detach(), mask),
    )
    return loss, stats


def batch_loss(
    logp: Tensor, batch: PackedBatch, cfg: LearnerConfig, ref_logp: Tensor | None = None
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO loss of one packed micro-batch under [learner]'s settings, as the train step takes it.

    `logp` (N,) are the learner's log-probs of the batch's trained tokens (with their graph),
    `ref_logp` (N,) the reference model's (None when kl_coef = 0).

    Every group, fresh or kept beyond max_staleness (stale_policy = "correct"), is trained as the
    off-policy data it is: the ratio r = exp(logp - mu) against the behaviour log-probs mu the
    actor recorded is the importance weight, and its clip is the trust region. A ratio against the
    learner's own pre-step log-probs would say nothing: there is one optimizer step per batch, so
    they equal logp, the ratio is 1 and the clip never binds. With behaviour_correction =
    "truncated_is" that ratio is a capped weight instead (truncated_is_loss), and nothing is clipped.
    """
    return grpo_loss(
        logp,
        batch.behaviour,
        batch.advantages,
        torch.ones_like(batch.behaviour, dtype=torch.bool),
        batch.seq,
        ref_logp=ref_logp,
        kl_coef=cfg.kl_coef,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip or None,
        agg_mode=cfg.loss_agg,
        correction=cfg.behaviour_correction,
        is_cap=cfg.is_cap,
    )


def samples_of(taken: Sequence[Taken], *, scale: bool, std: str, ref: bool) -> list[Sample]:
    """A step's groups as the trainer takes them: every sample with its group-relative advantage
    (`scale`, `std`: [learner] scale_advantages, adv_std) and, when `ref` ([policy] reference =
    "service"), the reference log-probs its Scored carries."""
    rewards = torch.tensor([t.group.rewards() for t in taken], dtype=torch.float64)  # (G, n)
    adv = group_advantages(rewards, scale=scale, std=std)  # (G, n)
    out = []
    for gi, t in enumerate(taken):
        for si, s in enumerate(t.group.ordered()):
            traj = s.trajectory
            out.append(
                Sample(
                    s.traj_id,
                    arrays.token_ids(traj),
                    arrays.loss_mask(traj),
                    behaviour_logprobs(traj),
                    float(adv[gi, si]),
                    ref=arrays.ref_logprobs(s) if ref else None,
                    temperature=traj.temperature,
                )
            )
    return out
