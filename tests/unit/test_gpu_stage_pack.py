"""bench/gpu_stage/pack.py: the staging calls fit the room a call leaves beside the checkout, carry at most
8 paths, take the smol checksum along with a smol piece, and end with .whl (the call that runs the work)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("pack", ROOT / "bench/gpu_stage/pack.py")
pack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pack)


def files(tmp_path: Path, sizes: dict[str, int]) -> None:
    for name, n in sizes.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * n)


def test_first_fit_puts_the_largest_first_and_never_overfills_a_bin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files(tmp_path, {"a": 60, "b": 50, "c": 40, "d": 30, "e": 20, "f": 10})
    bins = pack.first_fit(["f", "e", "d", "c", "b", "a"], room=100, most=2)
    assert bins == [["a", "c"], ["b", "d"], ["e", "f"]]
    assert all(sum(pack.size(p) for p in b) <= 100 and len(b) <= 2 for b in bins)


def test_the_folders_hold_every_file_once_within_the_room(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    files(src, {"big.whl.part1-of-2": 90, "big.whl.part2-of-2": 30, "x.whl": 60, "y.whl": 10})
    pack.folders(str(src), str(dst), 100)
    held = {p.name: p.parent.name for p in dst.rglob("*") if p.is_file()}
    assert sorted(held) == ["big.whl.part1-of-2", "big.whl.part2-of-2", "x.whl", "y.whl"] and not list(src.iterdir())
    assert all(pack.size(str(d)) <= 100 for d in dst.iterdir())
    assert held["big.whl.part1-of-2"] == "e1" and held["x.whl"] == "e2"


def test_the_calls_end_with_whl_and_carry_the_smol_checksum_with_a_piece(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files(
        tmp_path,
        {
            ".gpu/parts/site.part1-of-2": 90,
            ".gpu/parts/site.part2-of-2": 20,
            ".gpu/smol/w.whl.part1-of-2": 50,
            ".gpu/smol/w.whl.part2-of-2": 45,
            ".gpu/smol/SHA256SUMS": 1,
            ".whl/a.whl": 5,
        },
    )
    units = [
        ".gpu/parts/site.part1-of-2",
        ".gpu/parts/site.part2-of-2",
        ".gpu/smol/w.whl.part1-of-2",
        ".gpu/smol/w.whl.part2-of-2",
    ]
    pack.calls(100, "CALLS", units)
    calls = [json.loads(line) for line in Path("CALLS").read_text().splitlines()]
    assert all(c[0] == ".gpu/tools" and len(c) <= 8 for c in calls)
    assert calls[-1] == [".gpu/tools", ".whl"]
    carried = [p for c in calls[:-1] for p in c[1:]]
    assert sorted(carried) == sorted([*units, ".gpu/smol/SHA256SUMS"])
    sums = next(c for c in calls if ".gpu/smol/SHA256SUMS" in c)
    assert any(p.startswith(".gpu/smol/w.whl.part") for p in sums)
    assert all(sum(pack.size(p) for p in c[1:] if p != ".gpu/smol/SHA256SUMS") <= 100 for c in calls[:-1])
