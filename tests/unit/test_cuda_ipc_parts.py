"""The cuda_ipc transport's parts that run without a GPU: the buffer layout and packing, the
checksums both sides compute and their comparison (what makes a wrong transfer a refusal), the
announcement on the wire, the learner's choice of buffer, and the CPU refusals."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
import torch

from parley.config.learner import LearnerConfig
from parley.protocol import codec
from parley.protocol.messages import CudaIpcBuffer, WeightVersion
from parley.weights import common, cuda_ipc, registry
from parley.weights.common import WeightUnavailable
from parley.weights.config import CudaIpcWeights
from parley.weights.cuda_ipc import IpcPublisher
from tests.driver_double import DriverDouble


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(40, 64, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(7, generator=g).to(torch.bfloat16)),  # odd size: padded
        ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 64, generator=g)),  # fp32 beside bf16
    ]


def packed():
    tensors = named()
    layout, total = cuda_ipc.plan(tensors)
    buf = torch.zeros(total, dtype=torch.uint8)
    cuda_ipc.pack(tensors, buf, layout)
    return tensors, layout, buf


def test_layout_is_aligned_and_views_give_the_tensors_back():
    tensors, layout, buf = packed()
    assert all(e.offset % cuda_ipc.ALIGN == 0 for e in layout)
    assert [e.dtype for e in layout] == ["bfloat16", "bfloat16", "float32"]
    for (name, t), e in zip(tensors, layout):
        assert e.name == name and torch.equal(cuda_ipc.view(buf, e), t)


def test_views_in_one_pass_are_the_same_tensors_as_view_and_refuse_an_entry_outside_the_buffer():
    tensors, layout, buf = packed()
    layout = layout + [msgspec.structs.replace(layout[1], name="scalar", shape=[])]  # a 0-d tensor too
    for b in (buf, torch.cat([torch.zeros(256, dtype=torch.uint8), buf])[256:]):  # and at a storage offset
        for e, v in zip(layout, cuda_ipc.views(b, layout), strict=True):
            one = cuda_ipc.view(b, e)
            assert (v.dtype, v.shape, v.data_ptr(), v.is_contiguous()) == (one.dtype, one.shape, one.data_ptr(), True)
            assert torch.equal(v, one)
    past = msgspec.structs.replace(layout[0], offset=buf.numel() - 2)
    with pytest.raises(ValueError, match="outside the"):
        cuda_ipc.views(buf, [past])


def test_checksums_refuse_a_changed_byte_a_moved_row_and_a_partial_copy():
    _, layout, buf = packed()
    announced = cuda_ipc.with_checksums(layout, cuda_ipc.checksums(buf, layout))
    assert cuda_ipc.mismatch(announced, cuda_ipc.checksums(buf.clone(), layout)) is None

    flipped = buf.clone()
    flipped[layout[1].offset + 3] ^= 0x10
    assert cuda_ipc.mismatch(announced, cuda_ipc.checksums(flipped, layout)) == (
        "checksum mismatch in 1 of 3 tensors (first: model.norm.weight)"
    )

    # two rows of the embedding swapped: every value is still there, only the order changed
    swapped = buf.clone()
    rows = cuda_ipc.view(swapped, layout[0])
    rows[[0, 1]] = rows[[1, 0]]
    assert "model.embed_tokens.weight" in cuda_ipc.mismatch(announced, cuda_ipc.checksums(swapped, layout))

    partial = buf.clone()
    partial[layout[2].offset + 512 :] = 0  # the copy stopped half-way through the last tensor
    assert "1 of 3" in cuda_ipc.mismatch(announced, cuda_ipc.checksums(partial, layout))
    assert cuda_ipc.mismatch(announced[:2], cuda_ipc.checksums(buf, layout)) == "3 checksums for 2 announced tensors"


def test_pack_refuses_tensors_it_was_not_planned_for():
    tensors, layout, buf = packed()
    with pytest.raises(ValueError, match="names or order differ"):
        cuda_ipc.pack(tensors[::-1], buf, layout)
    wrong = [(n, t.float()) if i == 0 else (n, t) for i, (n, t) in enumerate(tensors)]
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        cuda_ipc.pack(wrong, buf, layout)


def announcement(tensors) -> WeightVersion:
    ipc = CudaIpcBuffer(
        device_uuid="GPU-0",
        storage_handle=b"\x01" * 64,
        storage_size=1 << 20,
        storage_offset=512,
        ref_counter_handle=b"/torch_1_2",
        ref_counter_offset=3,
        event_handle=b"\x02" * 64,
        event_sync_required=True,
        nbytes=768,
        hold_s=30.0,
        tensors=tensors,
    )
    return WeightVersion(
        version=4,
        step=4,
        transport="cuda_ipc",
        location="cuda:GPU-0",
        sha256=cuda_ipc.table_digest(tensors),
        bytes=768,
        created=1.0,
        run="r",
        ipc=ipc,
    )


def test_announcement_round_trips_and_older_ones_still_decode():
    _, layout, buf = packed()
    wv = announcement(cuda_ipc.with_checksums(layout, cuda_ipc.checksums(buf, layout)))
    assert codec.decode("weights", codec.encode(wv)) == wv

    class OldWeightVersion(msgspec.Struct, kw_only=True):  # the schema before cuda_ipc
        version: int
        step: int
        transport: str
        location: str
        sha256: str
        bytes: int
        created: float
        run: str = ""
        files: list[str] = []

    old = OldWeightVersion(
        version=1,
        step=1,
        transport="objstore",
        location="v000001/model.safetensors",
        sha256="0" * 64,
        bytes=10,
        created=0.0,
        files=["v000001/config.json"],
    )
    decoded = codec.decode("weights", msgspec.msgpack.encode(old))
    assert decoded.ipc is None and decoded.files == ["v000001/config.json"]


def test_table_digest_changes_with_any_checksum():
    _, layout, buf = packed()
    a = cuda_ipc.with_checksums(layout, cuda_ipc.checksums(buf, layout))
    b = list(a)
    b[2] = msgspec.structs.replace(b[2], checksum=[b[2].checksum[0] + 1, *b[2].checksum[1:]])
    assert cuda_ipc.table_digest(a) != cuda_ipc.table_digest(b)


def test_file_paths_refuse_the_gpu_transport():
    with pytest.raises(ValueError, match="publish_gpu_version"):
        asyncio.run(registry.publish_version(None, "r", 1, 1, "/nonexistent", CudaIpcWeights()))
    wv = announcement([])
    with pytest.raises(common.WeightVerifyError, match="loaded by the engine"):
        asyncio.run(registry.fetch_version(None, "r", wv, "/nonexistent"))


@pytest.fixture
def clock(monkeypatch):
    """The publisher's monotonic clock, set by hand: clock(t0) returns [t], advanced by the test."""

    def start(t0: float) -> list[float]:
        now = [t0]
        monkeypatch.setattr("parley.weights.cuda_ipc.time.monotonic", lambda: now[0])
        return now

    return start


def test_publisher_never_writes_into_a_buffer_younger_than_its_hold_time(clock):
    now = clock(100.0)
    pub = IpcPublisher(hold_s=10.0, max_buffers=2)
    tensors = named()
    b1, t1 = pub.fill(tensors, 1)
    assert torch.equal(cuda_ipc.view(b1, t1[0]), tensors[0][1])
    now[0] += 5.0
    b2, _ = pub.fill(tensors, 2)  # v1's buffer was filled 5 s ago: a second buffer
    assert b2.data_ptr() != b1.data_ptr()
    now[0] += 4.0
    before = [b.data.clone() for b in pub.buffers]
    other = [(n, t + 1) for n, t in tensors]
    assert pub.fill(other, 3) is None and pub.skipped == [3]  # both younger than 10 s, no room: not published
    assert all(torch.equal(b.data, old) for b, old in zip(pub.buffers, before))  # nothing was written
    for v in (1, 2):  # both versions are still served
        held = pub.take(v)
        assert held is not None
        pub.release(held)
    now[0] += 1.0  # v1's buffer is 10 s old: reused; v2's (5 s) is not
    b4, t4 = pub.fill(other, 4)
    assert b4.data_ptr() == b1.data_ptr() and torch.equal(cuda_ipc.view(b4, t4[0]), other[0][1])
    assert pub.take(1) is None and len(pub.buffers) == 2
    with pytest.raises(RuntimeError, match="planned once"):
        pub.fill(tensors[:2], 5)


def test_a_later_fill_refuses_tensors_of_another_shape_dtype_or_name_and_writes_nothing():
    # fills after the first reuse the first one's plan and views: a tensor set that differs from
    # that plan in any tensor's shape, dtype or name (the byte count may be the same) must be
    # refused before a byte is copied, not packed into the old layout
    pub = IpcPublisher(hold_s=0.0, max_buffers=1)
    tensors = named()
    buf, table = pub.fill(tensors, 1)
    before = buf.clone()
    same_bytes = [
        [(n, t.reshape(64, 40) if i == 0 else t) for i, (n, t) in enumerate(tensors)],  # transposed shape
        [(n, t.view(torch.float16) if i == 0 else t) for i, (n, t) in enumerate(tensors)],  # bf16 -> fp16
        [("model.embed_tokens.other" if i == 0 else n, t) for i, (n, t) in enumerate(tensors)],  # renamed
    ]
    for v, other in enumerate(same_bytes, start=2):
        with pytest.raises(RuntimeError, match="planned once"):
            pub.fill(other, v)
        assert torch.equal(pub.buffers[0].data, before)
    moved = [(n, t + 1) for n, t in tensors]  # the same plan: packed into the kept views
    buf2, table2 = pub.fill(moved, 5)
    assert buf2.data_ptr() == buf.data_ptr() and table2 != table
    for (name, t), e in zip(moved, table2):
        assert torch.equal(cuda_ipc.view(buf2, e), t), name


def _adapter_like(flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into one flat tensor, as DeepSpeed's ZeRO-1/2 optimizer holds the trained parameters:
    in module order (q before k), which is not the sorted order of their names (k before q)."""
    shapes = {"l0.q.A": (4, 32), "l0.q.B": (64, 4), "l0.k.A": (4, 32), "l0.k.B": (64, 4)}  # 128, 256 elements
    out, at = {}, 0
    for name, shape in shapes.items():
        n = shape[0] * shape[1]
        out[name] = flat[at : at + n].view(shape)
        at += n
    return sorted(out.items())


def test_tensors_end_to_end_in_one_storage_are_planned_in_that_order_and_filled_in_one_copy(monkeypatch):
    """An adapter's parameters under ZeRO-1/2 lie end to end in one flat buffer, in another order than
    their sorted names: the layout follows the storage, and each fill is one copy of the span (counted
    in fills_one_copy; the per-tensor pack is not called), giving every tensor back bit for bit. Once
    a tensor is elsewhere (its parameter re-pointed) the fill copies tensor by tensor again."""
    flat = torch.randn(768, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tensors = _adapter_like(flat)
    assert [n for n, _ in tensors] == ["l0.k.A", "l0.k.B", "l0.q.A", "l0.q.B"] and cuda_ipc.one_run(tensors) == [
        2,
        3,
        0,
        1,
    ]
    pub = IpcPublisher(hold_s=0.0, max_buffers=1)
    per_tensor = []
    real_pack = cuda_ipc.pack
    monkeypatch.setattr(cuda_ipc, "pack", lambda *a, **kw: per_tensor.append(1) or real_pack(*a, **kw))
    for v in (1, 2):
        flat.add_(1)  # a step: the parameters change in place
        buf, table = pub.fill(tensors, v)
        assert [e.name for e in table] == ["l0.q.A", "l0.q.B", "l0.k.A", "l0.k.B"] and cuda_ipc.gapless(table)
        for name, t in tensors:
            assert torch.equal(cuda_ipc.view(buf, next(e for e in table if e.name == name)), t), name
    assert pub.fills_one_copy == 2 and per_tensor == []
    moved = [(n, t.clone() + 1 if n == "l0.k.A" else t) for n, t in tensors]  # one parameter re-pointed
    buf, table = pub.fill(moved, 3)
    assert pub.fills_one_copy == 2 and per_tensor == [1]
    for name, t in moved:
        assert torch.equal(cuda_ipc.view(buf, next(e for e in table if e.name == name)), t), name


def test_tensors_not_end_to_end_in_one_storage_keep_their_order_and_are_copied_one_by_one():
    flat = torch.zeros(1024, dtype=torch.bfloat16)
    tensors = _adapter_like(flat[:768])
    gap = [(n, flat[800:928].view(4, 32) if n == "l0.k.A" else t) for n, t in tensors]  # a hole before it
    other = [(n, t.clone() if n == "l0.q.B" else t) for n, t in tensors]  # another storage
    mixed = [(n, t.float() if n == "l0.q.A" else t) for n, t in tensors]  # another dtype
    strided = [(n, t.t() if n == "l0.q.A" else t) for n, t in tensors]  # not contiguous
    for case in (gap, other, mixed, strided):
        assert cuda_ipc.one_run(case) is None
        pub = IpcPublisher(hold_s=0.0, max_buffers=1)
        buf, table = pub.fill(case, 1)
        assert [e.name for e in table] == [n for n, _ in case] and pub.fills_one_copy == 0
    odd = [("a", flat[:7]), ("b", flat[7:20])]  # end to end, but the layout pads "a" to ALIGN bytes
    pub = IpcPublisher(hold_s=0.0, max_buffers=1)
    buf, table = pub.fill(odd, 1)
    assert cuda_ipc.one_run(odd) == [0, 1] and not cuda_ipc.gapless(table) and pub.fills_one_copy == 0
    assert torch.equal(cuda_ipc.view(buf, table[1]), flat[7:20])


def test_one_buffer_is_refilled_once_its_hold_time_is_over(clock):
    now = clock(0.0)
    pub = IpcPublisher(hold_s=3.0, max_buffers=1)
    tensors = named()
    b1, _ = pub.fill(tensors, 1)
    now[0] += 2.9
    assert pub.fill(tensors, 2) is None  # the only buffer is still held
    now[0] += 0.1
    b3, _ = pub.fill(tensors, 3)
    assert b3.data_ptr() == b1.data_ptr() and len(pub.buffers) == 1 and pub.skipped == [2]


def test_writable_in_says_when_the_next_fill_finds_a_buffer(clock):
    now = clock(0.0)
    pub = IpcPublisher(hold_s=3.0, max_buffers=2)
    assert pub.writable_in() == 0.0  # none allocated yet
    pub.fill(named(), 1)
    assert pub.writable_in() == 0.0  # room for a second buffer
    now[0] += 1.0
    pub.fill(named(), 2)
    assert pub.writable_in() == pytest.approx(2.0)  # v1's buffer is free at 3 s
    now[0] += 2.0
    assert pub.writable_in() == 0.0 and pub.fill(named(), 3) is not None
    held = [pub.take(v) for v in (2, 3)]
    now[0] += 60.0
    assert pub.writable_in() == float("inf")  # both being sent from
    pub.release(held[0])
    assert pub.writable_in() == 0.0


def test_a_buffer_being_sent_from_is_never_refilled(clock):
    now = clock(0.0)
    pub = IpcPublisher(hold_s=1.0, max_buffers=1)
    pub.fill(named(), 1)
    buf = pub.take(1)  # an nccl send under way
    now[0] += 60.0
    assert pub.fill(named(), 2) is None
    pub.release(buf)
    assert pub.fill(named(), 3) is not None


def test_a_reader_loads_from_the_buffer_itself_only_with_half_the_hold_left():
    _, layout, buf = packed()
    sums = cuda_ipc.checksums(buf, layout)
    ipc = announcement(cuda_ipc.with_checksums(layout, sums)).ipc
    ipc = msgspec.structs.replace(ipc, hold_s=4.0, filled_at=1000.0)
    assert cuda_ipc.direct_deadline(ipc, now=1001.9) == 1004.0  # 2.1 s of 4 left
    assert cuda_ipc.direct_deadline(ipc, now=1002.1) is None  # under half: copy first
    assert cuda_ipc.direct_deadline(msgspec.structs.replace(ipc, filled_at=0.0), now=1.0) is None  # an older learner


def test_a_receive_for_keeping_copies_the_buffer_and_a_direct_one_reads_the_learners(monkeypatch):
    # an adapter staged for later (own=True) must not be a view into the learner's buffer, which the
    # learner refills once its hold is over; a direct load within the hold reads the buffer itself
    tensors, layout, buf = packed()
    ipc = msgspec.structs.replace(
        announcement(cuda_ipc.with_checksums(layout, cuda_ipc.checksums(buf, layout))).ipc,
        nbytes=buf.numel(),
        hold_s=60.0,
        filled_at=time.time(),
    )
    monkeypatch.setattr(cuda_ipc, "_open", lambda _ipc: buf)
    state: dict = {}
    direct, reason = cuda_ipc.receive(ipc, torch.device("cpu"), state)
    assert reason is None and "direct" in state
    kept, reason = cuda_ipc.receive(ipc, torch.device("cpu"), {}, own=True)
    assert reason is None
    for (name, want), (_, d), (_, k) in zip(tensors, direct, kept):
        assert torch.equal(d, want) and torch.equal(k, want), name
    buf.zero_()  # the learner refills its buffer
    assert not torch.equal(direct[0][1], tensors[0][1])  # the direct views saw it
    for (name, want), (_, k) in zip(tensors, kept):
        assert torch.equal(k, want), name  # the kept copy did not


def test_after_load_finds_a_buffer_changed_past_its_hold():
    _, layout, buf = packed()
    ipc = msgspec.structs.replace(
        announcement(cuda_ipc.with_checksums(layout, cuda_ipc.checksums(buf, layout))).ipc, hold_s=4.0, filled_at=1000.0
    )
    state = {"direct": (buf, ipc, 1004.0)}
    assert cuda_ipc.after_load(state, now=1005.0) is None and state == {}  # late, but unchanged
    buf[layout[2].offset] ^= 0x01
    state = {"direct": (buf, ipc, 1004.0)}
    assert cuda_ipc.after_load(dict(state), now=1003.0) is None  # within the hold: the promise covers it
    reason = cuda_ipc.after_load(state, now=1005.0)
    assert "changed while it was loaded" in reason and "model.layers.0.mlp.up_proj.weight" in reason
    assert cuda_ipc.after_load({}) is None  # a staged (copied) load: nothing to check


def test_learner_config_and_cpu_trainer_refuse_bad_ipc_settings():
    with pytest.raises(ValueError, match="hold_s=0"):
        CudaIpcWeights(hold_s=0)
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal needs a machine without CUDA")
    from parley.learner.trainer import Trainer

    with pytest.raises(ValueError, match="cuda_ipc.*no CUDA device"):
        Trainer(LearnerConfig(), "/nonexistent", weights=CudaIpcWeights())


def test_whole_buffer_sums_equal_the_per_tensor_definition():
    g = torch.Generator().manual_seed(1)
    tensors = [
        (f"t{i}", torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g).to(torch.bfloat16))
        for i in range(20)
    ]
    layout, total = cuda_ipc.plan(tensors)
    buf = torch.zeros(total, dtype=torch.uint8)
    cuda_ipc.pack(tensors, buf, layout)
    for e, (s1, s2, _) in zip(layout, cuda_ipc.checksums(buf, layout)):
        size = -(-cuda_ipc._nbytes(e) // cuda_ipc.ALIGN) * cuda_ipc.ALIGN
        words = buf[e.offset : e.offset + size].view(torch.int32).view(-1, 64).to(torch.int64)
        assert s1 == int(words.sum())
        assert s2 == int((words.sum(1) * torch.arange(1, words.shape[0] + 1)).sum())


def test_a_version_whose_buffers_are_all_held_is_counted_and_never_announced(tmp_path):
    """weights.publish.Weights with a GPU transport: a pack that returns None (IpcPublisher.fill
    found every buffer held) submits nothing, so nothing is announced and the feeder's version stays;
    the heartbeat's weights.skipped_held counts it. Test doubles for the driver and feeder."""
    from parley.config.learner import LearnerConfig
    from parley.learner.service import weights_publication
    from parley.weights.publish import Publisher

    class FeederDouble:
        version = None

        def set_version(self, v):
            self.version = v

    packs = {3: None}
    calls = []

    def driver(op, version):
        calls.append((op, version))
        return packs[version]

    feeder, publisher = FeederDouble(), Publisher()
    weights = weights_publication(
        LearnerConfig(), CudaIpcWeights(), None, None, "r", tmp_path, DriverDouble.of(driver), publisher, feeder
    )
    assert asyncio.run(weights.publish(3)) is False
    assert calls == [("pack_weights", 3)] and not publisher.busy() and feeder.version is None
    assert publisher.counters["skipped_held"] == 1 and publisher.counters["published"] == 0


def test_a_version_skipped_for_held_buffers_is_published_once_a_buffer_frees_without_another_step(tmp_path):
    """The learner's admission may wait for the skipped version itself (actors on an older one, and
    max_staleness admitting no task at it): no data comes, so no step and no publish. Weights.retry_held,
    called every round of the learner's loop, packs the held-back version as soon as the trainer says
    a buffer may be written, and not before; a later step's publish replaces it. Test doubles for the
    driver, feeder and publisher (seen on the H200: 5 steps, then none, versions 4 and 5 skipped)."""
    from collections import Counter

    from parley.config.learner import LearnerConfig
    from parley.learner.service import weights_publication

    class PublisherDouble:
        def __init__(self):
            self.submitted, self.counters = [], Counter()

        def submit(self, pub):
            self.submitted.append(pub.version)

    state = {"writable_in": 1.5, "free": False}
    calls = []

    def driver(op, *args):
        calls.append(op)
        if op == "weights_writable_in":
            return state["writable_in"]
        return "source" if state["free"] else None

    publisher = PublisherDouble()
    weights = weights_publication(
        LearnerConfig(), CudaIpcWeights(), None, None, "r", tmp_path, DriverDouble.of(driver), publisher, None
    )
    assert asyncio.run(weights.retry_held()) is None and calls == []  # nothing held back: no trainer call
    assert asyncio.run(weights.publish(3)) is False
    assert asyncio.run(weights.retry_held()) == 1.5  # still held: not packed, the loop waits that long at most
    assert calls == ["pack_weights", "weights_writable_in"] and publisher.submitted == []
    state.update(writable_in=0.0, free=True)
    assert asyncio.run(weights.retry_held()) is None
    assert publisher.submitted == [3] and publisher.counters["published_after_held"] == 1
    assert asyncio.run(weights.retry_held()) is None and publisher.submitted == [3]  # once
    state.update(writable_in=2.0, free=False)
    asyncio.run(weights.publish(4))
    state.update(free=True)
    asyncio.run(weights.publish(5))  # a step's own publish: nothing of 4 is left to retry
    assert weights.held is None and publisher.submitted == [3, 5]


_FUSED_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from parley.weights import cuda_ipc
gen = torch.Generator().manual_seed(3)
tensors = [("a", torch.randn(1000, generator=gen).to(torch.bfloat16)), ("b", torch.randn(70, 33, generator=gen)),
           ("c", torch.randint(-2**31, 2**31 - 1, (129, 64), dtype=torch.int32, generator=gen))]
tensors[2][1][0].fill_(2**31 - 1)  # the products of the largest words wrap in int32
tensors[2][1][1].fill_(-2**31)
layout, total = cuda_ipc.plan(tensors)
buf = torch.zeros(total, dtype=torch.uint8)
cuda_ipc.pack(tensors, buf, layout)
fused, plain = cuda_ipc.checksums(buf, layout, impl="triton"), cuda_ipc.checksums(buf, layout, impl="torch")
print(fused == plain, fused != cuda_ipc.checksums(buf.roll(256), layout, impl="triton"))
"""


def test_the_fused_triton_checksum_gives_torchs_sums_exactly():
    """The GPU's default checksum (one Triton pass over the buffer) against torch's kernels, on
    Triton's CPU interpreter: equal sums for tensors of three dtypes, words at the int32 extremes
    included (the column-weighted products wrap as in torch's int32 multiply); moving the buffer by
    one row changes them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-c", _FUSED_SCRIPT, root],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"]


def test_the_last_version_skipped_for_held_buffers_is_published_before_the_learner_stops(tmp_path):
    """Weights.flush_held, after the loop: the held-back last version is packed once a buffer frees
    (within the hold), and given up with a warning, not waited for forever, when none does."""
    from collections import Counter

    from parley.config.learner import LearnerConfig
    from parley.learner.service import weights_publication

    class PublisherDouble:
        def __init__(self):
            self.submitted, self.counters = [], Counter()

        def submit(self, pub):
            self.submitted.append(pub.version)

    free_at = [time.monotonic() + 0.3]

    def driver(op, *args):
        left = free_at[0] - time.monotonic()
        if op == "weights_writable_in":
            return max(0.0, left)
        return "source" if left <= 0 else None

    publisher = PublisherDouble()
    weights = weights_publication(
        LearnerConfig(), CudaIpcWeights(), None, None, "r", tmp_path, DriverDouble.of(driver), publisher, None
    )
    assert asyncio.run(weights.publish(30)) is False
    assert asyncio.run(weights.flush_held(2.0)) is True and publisher.submitted == [30]
    free_at[0] = float("inf")  # every buffer being sent from, for good
    assert asyncio.run(weights.publish(31)) is False
    t = time.monotonic()
    assert asyncio.run(weights.flush_held(0.3)) is False and publisher.submitted == [30]
    assert time.monotonic() - t < 1.5


def test_an_adapter_version_under_cuda_ipc_is_packed_announced_with_its_config_and_written_for_export(
    tmp_path, monkeypatch
):
    """[learner.lora] with cuda_ipc: Weights.publish packs the adapter alone (the driver's
    pack_adapter), hands an announcement job to the publisher, and writes the adapter's files under
    the version's weights directory (the periodic eval and parley export read them): after the
    announcement, beside the next step, or at once when the eval exports that version next or the
    version was held back. A held version is kept back and retry_held packs the adapter again, not
    whole weights. The announcement carries the base, rank and peft config and round-trips on the
    wire; nccl refuses. Test doubles for the driver, publisher, feeder and the announcement's bus."""
    from collections import Counter

    from parley.learner import checkpoint as ckpt
    from parley.learner.service import weights_publication
    from parley.weights import lora

    class PublisherDouble:
        def __init__(self):
            self.submitted, self.counters = [], Counter()

        def submit(self, pub):
            self.submitted.append(pub)

    class FeederDouble:
        version = 0

        def set_version(self, v):
            self.version = v

    class Announced:
        bytes, transport = 1, "cuda_ipc"

    announced = []

    async def publish_adapter_gpu(js, run, version, step, source, **kw):
        announced.append((version, ckpt.weights_dir(tmp_path, version).is_dir()))
        return Announced()

    monkeypatch.setattr(lora, "publish_adapter_gpu", publish_adapter_gpu)
    conf = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
    tensors = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(4, 8)}
    state = {"free": True}
    calls = []

    def driver(op, *args):
        calls.append(op)
        if op == "pack_adapter":
            return ("source" if state["free"] else None), conf
        if op == "adapter_snapshot":
            return tensors, conf
        return 0.0  # weights_writable_in

    publisher, feeder = PublisherDouble(), FeederDouble()
    weights = weights_publication(
        LearnerConfig(),
        CudaIpcWeights(),
        None,
        None,
        "r",
        tmp_path,
        DriverDouble.of(driver),
        publisher,
        feeder,
        adapter_base="b" * 32,
    )

    async def publish_and_announce(version, **kw):
        published = await weights.publish(version, **kw)
        written_at_publish = (ckpt.weights_dir(tmp_path, version) / lora.ADAPTER_CONFIG).is_file()
        await publisher.submitted[-1].job()
        return published, written_at_publish

    assert asyncio.run(publish_and_announce(1)) == (True, False)  # the step did not wait for the write
    assert calls == ["pack_adapter", "adapter_snapshot"] and [p.version for p in publisher.submitted] == [1]
    assert announced == [(1, False)] and feeder.version == 1  # announced first, then written
    assert (ckpt.weights_dir(tmp_path, 1) / lora.ADAPTER_CONFIG).is_file()
    assert asyncio.run(publish_and_announce(2, write_now=True)) == (True, True)  # the eval exports it next
    state["free"] = False
    assert asyncio.run(weights.publish(3)) is False and weights.held == 3
    assert (ckpt.weights_dir(tmp_path, 3) / lora.ADAPTER_CONFIG).is_file()  # held: no announcement soon
    assert publisher.counters["skipped_held"] == 1 and len(publisher.submitted) == 2
    state["free"] = True
    calls.clear()
    assert asyncio.run(weights.retry_held()) is None
    assert calls == ["weights_writable_in", "pack_adapter"] and [p.version for p in publisher.submitted] == [1, 2, 3]
    asyncio.run(publisher.submitted[-1].job())  # its files are there already: nothing waits for a snapshot
    assert announced[-1] == (3, True) and calls == ["weights_writable_in", "pack_adapter"]
    monkeypatch.undo()  # the real publish_adapter_gpu below

    _, layout, buf = packed()
    source = cuda_ipc.CudaIpcBuffer(
        device_uuid="GPU-x",
        storage_handle=b"h",
        storage_size=buf.numel(),
        storage_offset=0,
        ref_counter_handle=b"r",
        ref_counter_offset=0,
        event_handle=b"",
        event_sync_required=False,
        nbytes=buf.numel(),
        hold_s=2.0,
        tensors=cuda_ipc.with_checksums(layout, cuda_ipc.checksums(buf, layout)),
    )

    sent = []

    async def announce(js, run, wv):
        sent.append(wv)

    real = lora.announce
    lora.announce = announce
    try:
        wv = asyncio.run(lora.publish_adapter_gpu(None, "r", 3, 3, source, base="b" * 32, rank=4, adapter_config=conf))
    finally:
        lora.announce = real
    back = codec.decode("weights", codec.encode(sent[0]))
    assert back == wv and back.transport == "cuda_ipc" and back.ipc is not None
    assert back.adapter.base == "b" * 32 and back.adapter.rank == 4 and json.loads(back.adapter.config) == conf


def test_an_adapter_reader_opens_each_learner_buffer_once(monkeypatch):
    # receive(own=True) copies the buffer out, so the mapping can stay open for the learner's next fill
    # of the same buffer: a second version in it opens nothing and gives back its export's counter; a
    # direct (whole-weight) receive still opens and closes each time; at most KEEP_OPEN stay mapped
    tensors, layout, buf = packed()
    table = cuda_ipc.with_checksums(layout, cuda_ipc.checksums(buf, layout))
    opened, released = [], []

    def open_double(ipc):  # test double for the CUDA IPC open: a CPU buffer per handle
        opened.append(ipc.storage_handle)
        return buf

    monkeypatch.setattr(cuda_ipc, "_open", open_double)
    monkeypatch.setattr(cuda_ipc, "_release_counter", lambda ipc: released.append(ipc.ref_counter_offset))
    monkeypatch.setattr(cuda_ipc, "_kept", {})

    def ipc_of(handle: bytes, counter: int):
        return msgspec.structs.replace(
            announcement(table).ipc,
            storage_handle=handle,
            ref_counter_offset=counter,
            nbytes=buf.numel(),
            filled_at=0.0,
        )

    for counter, handle in enumerate([b"a", b"b", b"a", b"b", b"a"]):
        kept, reason = cuda_ipc.receive(ipc_of(handle, counter), torch.device("cpu"), {}, own=True)
        assert reason is None and all(torch.equal(k, want) for (_, k), (_, want) in zip(kept, tensors))
    assert opened == [b"a", b"b"] and released == [2, 3, 4]
    cuda_ipc.receive(ipc_of(b"a", 5), torch.device("cpu"), {})  # not for keeping: opened, not kept
    assert opened == [b"a", b"b", b"a"] and released == [2, 3, 4]
    for i in range(cuda_ipc.KEEP_OPEN):  # KEEP_OPEN other buffers push "a" and "b" out
        cuda_ipc.receive(ipc_of(bytes([i]), 10 + i), torch.device("cpu"), {}, own=True)
    assert len(cuda_ipc._kept) == cuda_ipc.KEEP_OPEN
    cuda_ipc.receive(ipc_of(b"a", 99), torch.device("cpu"), {}, own=True)
    assert opened[-1] == b"a" and 99 not in released
    # a kept mapping that disagrees with an announcement's checksums is not its word: no refusal, the
    # mapping is dropped and the next try opens the handle again
    wrong = msgspec.structs.replace(
        ipc_of(b"a", 100), tensors=[msgspec.structs.replace(t, checksum=[0, 0, 0]) for t in table]
    )
    with pytest.raises(WeightUnavailable, match="opened afresh"):
        cuda_ipc.receive(wrong, torch.device("cpu"), {}, own=True)
    assert (b"a", wrong.storage_offset) not in cuda_ipc._kept
    n = len(opened)
    cuda_ipc.receive(ipc_of(b"a", 101), torch.device("cpu"), {}, own=True)
    assert len(opened) == n + 1


def test_the_learner_hands_its_cache_back_only_when_the_actors_would_run_short():
    from parley.learner.trainer import cache_release_needed

    gib = 1 << 30
    # the 4B shape on the H200: 0.9 GiB free after a step, a 7.5 GiB version to copy: release
    assert cache_release_needed(int(0.9 * gib), int(7.5 * gib))
    # SmolLM2 on the H200: ~100 GiB free, a 0.25 GiB version: keep the cache for the next step
    assert not cache_release_needed(100 * gib, gib // 4)
    # the line: two versions and 1 GiB of room
    assert cache_release_needed(3 * gib - 1, gib) and not cache_release_needed(3 * gib, gib)


@pytest.mark.parametrize(
    "setting,free_gib,released", [("release", 100, True), ("keep_when_room", 100, False), ("keep_when_room", 1, True)]
)
def test_gpu_cache_decides_whether_the_step_hands_its_cache_back(monkeypatch, setting, free_gib, released):
    """Trainer._release_cache on a bare Trainer (no model), torch.cuda's memory calls replaced by doubles."""
    from parley.config.learner import LearnerConfig
    from parley.learner.trainer import Trainer

    calls = []
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 4 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 << 30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free_gib << 30, 141 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    t = Trainer.__new__(Trainer)
    t.cfg, t.release_cache, t.sender, t.n_params, t.device = (
        LearnerConfig(gpu_cache=setting),
        True,
        None,
        135_000_000,
        "cuda:0",
    )
    assert t._release_cache() is not None
    assert calls == (["empty"] if released else [])
