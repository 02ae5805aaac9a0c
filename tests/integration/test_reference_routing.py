"""One reference subject per model: with two reference services for different policies on one
cluster (two runs), every request reaches a service of the model it names. On one shared subject
and queue group about half of them reached the other model's service, which refused: the scorer
spent a delivery and redid the judge work. Real nats-server; the reference models are test doubles
(answering for their name without a model), the service and the client are the real ones."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from parley.protocol import arrays, examples
from parley.protocol.messages import ReferenceReply
from parley.services.reference.client import ReferenceClient
from parley.services.reference.server import reference_service

pytestmark = pytest.mark.integration


class ReferenceModelDouble:
    """Answers like services.reference.server.ReferenceModel for `model_name`, with log-probs of -1."""

    def __init__(self, model_name: str):
        self.model_name = model_name

    async def answer(self, model: str, version: int, ids: np.ndarray) -> ReferenceReply:
        if model != self.model_name:
            return ReferenceReply(ok=False, model=self.model_name, error=f"holds {self.model_name!r}, not {model!r}")
        lp = np.full(ids.size - 1, -1.0, np.float32)
        return ReferenceReply(ok=True, logp_f32=arrays.pack_logprobs(lp), model=self.model_name)


async def test_each_request_reaches_a_service_of_its_model(nc):
    a = reference_service(nc, ReferenceModelDouble("policy-a"), name="ref-a")
    b = reference_service(nc, ReferenceModelDouble("/models/policy-b"), name="ref-b")  # a path: a digest subject
    await a.start()
    await b.start()
    try:
        answered: Counter[str] = Counter()
        for model in ("policy-a", "/models/policy-b"):
            client = ReferenceClient(nc, model=model, timeout=5)
            for i in range(16):
                traj = examples.trajectory("routing", task_id=f"t-{i}")
                lp = np.frombuffer(await client.logprobs(traj), dtype="<f4")
                assert lp.size == arrays.token_ids(traj).size and lp[0] == 0.0 and (lp[1:] == -1.0).all()
                answered[model] += 1
        assert answered == {"policy-a": 16, "/models/policy-b": 16}
        assert a.counters["refused"] == 0 and b.counters["refused"] == 0
        assert a.counters["ok"] == 16 and b.counters["ok"] == 16
    finally:
        await a.stop()
        await b.stop()
