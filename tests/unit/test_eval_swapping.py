"""`parley eval` keeps one policy engine across conditions that are checkpoints of one base: their
weights are loaded in place (engines.models.weights_swap_key, evaluation.runner.SwappingPolicies).
On the H200 each engine start cost ~50 s of the CollabLLM table's 7 arms (issue 31)."""

from __future__ import annotations

import asyncio
import json

from parley.engines.models import weights_swap_key
from parley.evaluation.runner import SwappingPolicies


def qwen3(hidden=64):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


def checkpoint(path, hidden=64, template="{{ messages }}", origin="a", whole=False):
    """A checkpoint directory's config and tokenizer files (no weights: the key reads none). whole: the
    config as the learner writes it with its weights (every field), not save_pretrained's diff."""
    path.mkdir(parents=True)
    config = qwen3(hidden)
    config._name_or_path = origin
    if whole:
        (path / "config.json").write_text(config.to_json_string(use_diff=False))
    else:
        config.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(path)


def test_checkpoints_of_one_base_share_a_key_and_other_shapes_or_tokenizers_do_not(tmp_path):
    a = checkpoint(tmp_path / "v0", origin="/run/a")
    b = checkpoint(tmp_path / "v60", origin="/elsewhere/b")  # only where it came from differs
    wider = checkpoint(tmp_path / "wide", hidden=128)
    templated = checkpoint(tmp_path / "tpl", template="{{ other }}")
    whole = checkpoint(tmp_path / "v50", whole=True)  # the learner's kept weights of a version
    assert (
        json.loads((tmp_path / "v50" / "config.json").read_text()).keys()
        != json.loads((tmp_path / "v0" / "config.json").read_text()).keys()
    )
    assert weights_swap_key(a) == weights_swap_key(b) == weights_swap_key(whole) is not None
    assert weights_swap_key(wider) != weights_swap_key(a)
    assert weights_swap_key(templated) != weights_swap_key(a)
    assert weights_swap_key("smol") is None and weights_swap_key(tmp_path / "missing") is None


class RecordingEngine:
    """Test double of PolicyEngine: records the weights loaded into it and its shutdown."""

    def __init__(self, model, events):
        self.model, self.events = model, events

    async def reload_weights(self, path, version=None):
        self.events.append(("reload", path))

    def shutdown(self):
        self.events.append(("shutdown", self.model))


def test_the_engine_is_started_once_per_base_and_each_checkpoint_is_swapped_in(tmp_path):
    v0, v30 = checkpoint(tmp_path / "v0"), checkpoint(tmp_path / "v30")
    other = checkpoint(tmp_path / "other", hidden=128)
    events: list = []

    def start(model):
        events.append(("start", model))
        return RecordingEngine(model, events), f"tok-{model}"

    policies = SwappingPolicies(start, version=-1)

    async def play():
        seen = [await policies(m) for m in (v0, v30, other, "smol")]
        await policies.close()
        return seen

    seen = asyncio.run(play())
    assert events == [
        ("start", v0),
        ("reload", v30),
        ("shutdown", v0),
        ("start", other),
        ("shutdown", other),
        ("start", "smol"),
        ("shutdown", "smol"),
    ]
    assert seen[0].engine is seen[1].engine and seen[2].engine is not seen[0].engine
    assert all(p.close is None for p in seen)  # the conditions leave the engine to the next one
    assert (policies.starts, policies.swaps) == (3, 1)
