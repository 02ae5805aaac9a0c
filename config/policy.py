"""[policy]: the model a run trains and where the KL's reference log-probs come from, the facts
that more than one role reads: the learner trains that model (and holds the local reference), the
scorer asks the reference service for it, `parley up` starts that service, `parley reference`
serves it. Decoded by config/run.py beside the roles' sections.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

# "local" = a frozen copy of the initial weights beside the policy, run in every step (learner.trainer);
# "service" = computed once per trajectory by the reference service (`parley reference`), asked by
# the scorer, carried in Scored.ref_logp_f32.
Reference = Literal["local", "service"]
REFERENCES = get_args(Reference)


class PolicySection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[policy]: the trained model and its reference (used when [learner] kl_coef > 0)."""

    # a local checkpoint directory, a built-in name (tiny, smol) or a Hugging Face Hub id with an optional
    # revision ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B@main"): engines/models.py resolves it
    model: Annotated[str, msgspec.Meta(min_length=1, description="a path, tiny, smol or a Hub id")] = "smol"
    reference: Reference = "local"
