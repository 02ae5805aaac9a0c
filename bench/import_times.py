"""Where a process's imports went, from a log written under PYTHONPROFILEIMPORTTIME=1 (issue 56: the
actor's 19.5 s from its first log line to its engine's start on a warm H100, 2026-12-07; part TT with
IMPORT_TIMES=1 brings the roles' whole logs back).

Python writes one line an import, `import time: <self us> | <cumulative us> | <name>`, the name indented
two spaces a level, a module after the modules it imported. A line may carry a process's prefix (vLLM
writes its engine core's output as `(EngineCore pid=N) ...`); each prefix is read as a process of its
own. Per process: the top-level imports (level 0: what the process's own code asked for) by cumulative
time, their sum, and the heaviest modules at any level by their own time.

    python bench/import_times.py actor_full.log [--top 15]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

LINE = re.compile(r"^(?P<who>\(.+?\) )?import time:\s+(?P<self>\d+) \|\s+(?P<cum>\d+) \| (?P<name>.*)$")


@dataclass(frozen=True)
class Imported:
    name: str
    level: int
    self_us: int
    cumulative_us: int


def parse(lines) -> dict[str, list[Imported]]:
    """The log's import lines, by process (its prefix, '' for none); the header line is skipped."""
    out: dict[str, list[Imported]] = defaultdict(list)
    for line in lines:
        m = LINE.match(line.rstrip("\n"))
        if m is None:
            continue
        raw = m.group("name")
        name = raw.lstrip(" ")
        out[(m.group("who") or "").strip()].append(
            Imported(name, (len(raw) - len(name)) // 2, int(m.group("self")), int(m.group("cum")))
        )
    return dict(out)


def summary(imports: list[Imported], top: int = 15) -> dict:
    """Top-level imports by cumulative time and their sum (s); the heaviest modules by their own time."""
    first = sorted((i for i in imports if i.level == 0), key=lambda i: -i.cumulative_us)
    own = sorted(imports, key=lambda i: -i.self_us)
    return {
        "modules": len(imports),
        "top_level_s": round(sum(i.cumulative_us for i in first) / 1e6, 3),
        "top_level": [(i.name, round(i.cumulative_us / 1e6, 3)) for i in first[:top]],
        "own_time": [(i.name, round(i.self_us / 1e6, 3)) for i in own[:top]],
    }


def render(by_process: dict[str, list[Imported]], top: int) -> str:
    lines = []
    for who, imports in by_process.items():
        s = summary(imports, top)
        lines.append(f"{who or 'the process'}: {s['modules']} imports, {s['top_level_s']:.2f} s at the top level")
        lines += [f"    {t:7.3f} s  {name}" for name, t in s["top_level"]]
        lines.append("  heaviest by own time:")
        lines += [f"    {t:7.3f} s  {name}" for name, t in s["own_time"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="a log written under PYTHONPROFILEIMPORTTIME=1")
    p.add_argument("--top", type=int, default=15, help="how many imports to list (default 15)")
    a = p.parse_args(argv)
    if not a.log.is_file():
        p.error(f"{a.log}: no such file")
    with a.log.open(errors="replace") as f:
        by_process = parse(f)
    if not by_process:
        print(f"{a.log}: no import-time lines (was it written under PYTHONPROFILEIMPORTTIME=1?)", file=sys.stderr)
        return 1
    print(render(by_process, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
