"""The judge's reliability, watched while training: a share of judged conversations gets a second
verdict (Scored.audit_metrics: a second judge, or the same judge at another seed), and this monitor
turns first and second verdicts into numbers the scorer's heartbeat carries (Prometheus, live view):

- agreement: share of audited judge metrics whose two verdicts lie within `tolerance` of each other,
  over the last `window` audited values (pooled, and per metric);
- tie share: share of sample pairs of one group (as this scorer saw them) whose judge metrics are
  equal: a tie gives the pair no advantage, so a judge that ties often gives GRPO little to learn from;
- drift across versions: agreement on the newest policy version's samples minus agreement on the
  oldest version's (each once it has min_samples audited values). A policy optimised against the
  judge can learn what fools it: its later samples are then judged less consistently.

It is flagged (`flagged` = 1, a warning logged once per fall) while agreement over the window is
below `min_agreement`. Pure Python; the scorer role (scorer/scorer.py) feeds it every Scored.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

_TIE = 1e-9  # two verdicts this close are the same number (they come from the same small rubric scales)
_GROUPS_KEPT = 512  # groups whose earlier samples are kept for the tie share
_VERSIONS_KEPT = 64  # policy versions whose agreement is kept (the oldest one always stays)


def audited(traj_id: str, fraction: float) -> bool:
    """Whether `traj_id` gets a second verdict: the same answer on every replica and redelivery."""
    return fraction > 0 and zlib.crc32(traj_id.encode()) / 2**32 < fraction


class JudgeReliability:
    """Rolling judge agreement, tie share and drift across policy versions of one scorer."""

    def __init__(
        self,
        metrics: Sequence[str],
        *,
        tolerance: float,
        min_agreement: float,
        window: int,
        min_samples: int,
        name: str = "scorer",
    ):
        self.metrics = tuple(metrics)  # the judge metrics of the reward (pure ones agree by construction)
        self.tolerance, self.min_agreement = tolerance, min_agreement
        self.window, self.min_samples, self.name = window, min_samples, name
        self.agree: deque[tuple[str, bool]] = deque(maxlen=window)  # (metric, agreed) per audited value
        self.ties: deque[bool] = deque(maxlen=window)  # per within-group pair of judged values
        self.groups: OrderedDict[str, list[Mapping[str, float]]] = OrderedDict()
        self.by_version: dict[int, list[int]] = {}  # policy version -> [agreed, audited]
        self.audited = 0
        self.flags = 0
        self.flagged = False
        self.gaps: deque[float] = deque(maxlen=window)

    def observe(
        self, task_id: str, version: int, first: Mapping[str, float], second: Mapping[str, float] | None
    ) -> None:
        """One judged sample: its first verdict's metrics, and its second's when it was audited."""
        judged = {m: float(first[m]) for m in self.metrics if m in first}
        if not judged:
            return
        earlier = self.groups.setdefault(task_id, [])
        self.groups.move_to_end(task_id)
        for other in earlier:
            for m, v in judged.items():
                if m in other:
                    self.ties.append(abs(v - other[m]) <= _TIE)
        earlier.append(judged)
        while len(self.groups) > _GROUPS_KEPT:
            self.groups.popitem(last=False)
        if second is None:
            return
        self.audited += 1
        counts = self.by_version.setdefault(version, [0, 0])
        for m, v in judged.items():
            if m not in second:
                continue
            ok = abs(v - float(second[m])) <= self.tolerance
            self.agree.append((m, ok))
            self.gaps.append(v - float(second[m]))
            counts[0] += ok
            counts[1] += 1
        if len(self.by_version) > _VERSIONS_KEPT:
            keep = {min(self.by_version), *sorted(self.by_version)[-(_VERSIONS_KEPT - 1) :]}
            self.by_version = {v: c for v, c in self.by_version.items() if v in keep}
        self._check()

    def agreement(self, metric: str | None = None) -> float:
        values = [ok for m, ok in self.agree if metric is None or m == metric]
        return sum(values) / len(values) if values else math.nan

    def drift(self) -> float:
        """Agreement on the newest policy version's samples minus on the oldest's (NaN until two
        versions have min_samples audited values each)."""
        ready = sorted(v for v, (_, n) in self.by_version.items() if n >= max(1, self.min_samples))
        if len(ready) < 2:
            return math.nan
        (a0, n0), (a1, n1) = self.by_version[ready[0]], self.by_version[ready[-1]]
        return a1 / n1 - a0 / n0

    def _check(self) -> None:
        agreement = self.agreement()
        low = len(self.agree) >= self.min_samples and agreement < self.min_agreement
        if low and not self.flagged:
            self.flags += 1
            log.warning(
                "%s: JUDGE UNRELIABLE: agreement %.3f < [scorer] audit_min_agreement %.3f over the last %d audited "
                "verdicts (second verdict within %.3g: %s); its rewards are noisy: check the judge, its prompt or model",
                self.name,
                agreement,
                self.min_agreement,
                len(self.agree),
                self.tolerance,
                ", ".join(f"{m} {self.agreement(m):.2f}" for m in self.metrics if not math.isnan(self.agreement(m))),
            )
        elif self.flagged and not low:
            log.info("%s: judge agreement back to %.3f (>= %.3f)", self.name, agreement, self.min_agreement)
        self.flagged = low

    def counters(self) -> dict[str, float]:
        """The heartbeat's judge_audit.* and judge.tie_share numbers (NaN ones left out)."""
        out = {
            "judge_audit.audited": float(self.audited),
            "judge_audit.flagged": float(self.flagged),
            "judge_audit.flags": float(self.flags),
        }
        values = {
            "judge_audit.agreement": self.agreement(),
            "judge_audit.drift": self.drift(),
            "judge_audit.gap": sum(self.gaps) / len(self.gaps) if self.gaps else math.nan,
            "judge.tie_share": sum(self.ties) / len(self.ties) if self.ties else math.nan,
        }
        values |= {f"judge_audit.agreement.{m}": self.agreement(m) for m in self.metrics}
        out |= {k: v for k, v in values.items() if not math.isnan(v)}
        return out
