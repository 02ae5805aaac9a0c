"""weights.gpu_delta on CPU torch (the same calls run on the GPU): a chain of deltas rebuilds the
last version bit for bit, a corrupted or misdirected delta is refused with the buffer back on its
base, and a delta that would be too large is not built."""

import pytest
import torch

from parley.weights import cuda_ipc, gpu_delta
from parley.weights.common import WeightVerifyError


def _versions(steps: int, lr: float, seed: int = 0):
    """Packed bf16 buffers of an fp32 master taking Adam-like steps (each weight moves by lr), as a
    learner publishes them: [(buffer, layout with checksums)]. Some weights sit at zero so that a
    step moves them across it (a jump of the 16-bit pattern: an exception in the format)."""
    g = torch.Generator().manual_seed(seed)
    master = {
        "embed.weight": torch.randn(300, 64, generator=g) * 0.02,
        "layer.0.q.weight": torch.randn(64, 64, generator=g) * 0.02,
        "norm.weight": torch.ones(64),
        "odd.bias": torch.zeros(37),
    }
    layout, size = cuda_ipc.plan((n, t.to(torch.bfloat16)) for n, t in master.items())
    out = []
    for k in range(steps + 1):
        if k:
            for t in master.values():
                t += lr * torch.sign(torch.randn(t.shape, generator=g))
        buf = torch.zeros(size, dtype=torch.uint8)
        cuda_ipc.pack(((n, t.to(torch.bfloat16)) for n, t in master.items()), buf, layout)
        out.append((buf, cuda_ipc.with_checksums(layout, cuda_ipc.checksums(buf, layout))))
    return out


def _delta(a, b, **kw):
    return gpu_delta.encode(a[0], b[0], cuda_ipc.table_digest(a[1]), cuda_ipc.table_digest(b[1]), **kw)


def test_a_chain_of_deltas_rebuilds_the_last_version_bit_for_bit():
    vs = _versions(4, 3e-5)
    served = vs[0][0].clone()
    exceptions = 0
    for prev, cur in zip(vs, vs[1:]):
        blob = _delta(prev, cur)
        header, _ = gpu_delta.read_header(blob)
        assert 0 < header.changed < header.words
        exceptions += header.exceptions
        gpu_delta.apply(served, blob, cuda_ipc.table_digest(prev[1]), cur[1])
        assert torch.equal(served, cur[0])
    assert exceptions > 0  # the weights at zero crossed it: the exception path ran too
    # smaller than the raw bytes of the changed words' positions and values
    assert len(_delta(vs[0], vs[1])) < 6 * gpu_delta.read_header(_delta(vs[0], vs[1]))[0].changed


def test_every_word_of_a_block_may_change():
    layout, size = cuda_ipc.plan([("w", torch.zeros(8 * gpu_delta.BLOCK, dtype=torch.bfloat16))])
    a = torch.zeros(size, dtype=torch.uint8)
    b = a.clone()
    b.view(torch.int16)[: 2 * gpu_delta.BLOCK] = torch.arange(2 * gpu_delta.BLOCK, dtype=torch.int16) * 300
    la = cuda_ipc.with_checksums(layout, cuda_ipc.checksums(a, layout))
    lb = cuda_ipc.with_checksums(layout, cuda_ipc.checksums(b, layout))
    blob = gpu_delta.encode(a, b, cuda_ipc.table_digest(la), cuda_ipc.table_digest(lb))
    assert gpu_delta.read_header(blob)[0].changed == 2 * gpu_delta.BLOCK - 1  # the first word stays 0
    gpu_delta.apply(a, blob, cuda_ipc.table_digest(la), lb)
    assert torch.equal(a, b)


def test_a_corrupted_delta_is_refused_and_the_buffer_keeps_its_base():
    v0, v1 = _versions(1, 3e-5)
    blob = bytearray(_delta(v0, v1))
    blob[-1] ^= 0x01  # the last diff or exception: a wrong word, same length
    served = v0[0].clone()
    with pytest.raises(WeightVerifyError, match="checksum mismatch"):
        gpu_delta.apply(served, bytes(blob), cuda_ipc.table_digest(v0[1]), v1[1])
    assert torch.equal(served, v0[0])


@pytest.mark.parametrize("cut", [1, 100])
def test_a_truncated_delta_is_refused_before_anything_is_written(cut):
    v0, v1 = _versions(1, 3e-5)
    served = v0[0].clone()
    with pytest.raises(WeightVerifyError, match="bytes of sections"):
        gpu_delta.apply(served, _delta(v0, v1)[:-cut], cuda_ipc.table_digest(v0[1]), v1[1])
    assert torch.equal(served, v0[0])


def test_a_delta_for_another_base_is_refused():
    v0, v1, v2 = _versions(2, 3e-5)
    served = v0[0].clone()
    with pytest.raises(WeightVerifyError, match="this buffer holds"):
        gpu_delta.apply(served, _delta(v1, v2), cuda_ipc.table_digest(v0[1]), v2[1])
    assert torch.equal(served, v0[0])


def test_no_delta_when_it_would_be_larger_than_the_share():
    v0, v1 = _versions(1, 3e-5)
    blob = _delta(v0, v1)
    share = (len(blob) - gpu_delta.read_header(blob)[1] - 1) / v1[0].numel()  # a byte under its sections
    assert _delta(v0, v1, max_share=share) is None
    assert _delta(v0, v1, max_share=share * 1.2) is not None


def test_a_check_that_fails_midway_leaves_the_buffer_on_its_base(monkeypatch):
    """Out of memory (say) while the result is checked: the words written are put back before the
    error goes on, so a packed copy never stays half-patched."""
    v0, v1 = _versions(1, 3e-5)
    served = v0[0].clone()

    def out_of_memory(*a, **kw):
        raise RuntimeError("CUDA out of memory (test double)")

    monkeypatch.setattr(cuda_ipc, "checksums", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        gpu_delta.apply(served, _delta(v0, v1), cuda_ipc.table_digest(v0[1]), v1[1])
    assert torch.equal(served, v0[0])


def test_in_chunks_the_delta_is_the_same_bytes_and_a_failure_in_a_late_chunk_puts_every_chunk_back(monkeypatch):
    """Encoded and applied a few blocks at a time (CHUNK_BLOCKS, 2^18 blocks on the GPU; 3 here, so
    the buffer's ~100 blocks make many chunks with changes in each): the same bytes as in one piece,
    the same result, the undo restores the base, and a corruption found after the last chunk was
    written (a wrong exception word, the check fails) leaves the buffer on its base."""
    vs = _versions(2, 3e-5)
    whole = [_delta(a, b) for a, b in zip(vs, vs[1:])]
    monkeypatch.setattr(gpu_delta, "CHUNK_BLOCKS", 3)
    assert len(gpu_delta._chunk_words(vs[0][0].numel() // 2)) > 20
    assert [_delta(a, b) for a, b in zip(vs, vs[1:])] == whole
    served = vs[0][0].clone()
    undo = gpu_delta.apply(served, whole[0], cuda_ipc.table_digest(vs[0][1]), vs[1][1])
    assert torch.equal(served, vs[1][0])
    undo()
    assert torch.equal(served, vs[0][0])
    blob = bytearray(whole[0])
    blob[-1] ^= 0x40  # the last section: an exception word, in the buffer's last chunk with changes
    with pytest.raises(WeightVerifyError, match="checksum mismatch"):
        gpu_delta.apply(served, bytes(blob), cuda_ipc.table_digest(vs[0][1]), vs[1][1])
    assert torch.equal(served, vs[0][0])
    for prev, cur, blob in zip(vs, vs[1:], whole):  # the chain, chunk by chunk
        gpu_delta.apply(served, blob, cuda_ipc.table_digest(prev[1]), cur[1])
    assert torch.equal(served, vs[-1][0])


def _named(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        ("a", (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16)),
        ("b", torch.ones(8, dtype=torch.bfloat16)),
    ]


def test_packed_versions_chain_with_deltas_encoded_later_and_files_from_the_buffer():
    learner, actor = gpu_delta.PackedVersions(), gpu_delta.Mirror()
    named = _named(0)
    table, pending = learner.pack(named, 1, 0.5)
    assert pending.encode() == (None, None, None)  # nothing packed before it
    actor.fill(pending.host_state(), table, "cpu")  # the full file's tensors, from the buffer
    assert pending.done.is_set()
    for v in (2, 3):
        flat = named[0][1].view(-1)
        flat[::37] = (flat[::37].float() * 1.02).to(torch.bfloat16)
        table, pending = learner.pack(named, v, 0.5)
        blob, base_version, base = pending.encode()
        assert (base_version, base) == (v - 1, actor.name)
        actor.apply(blob, table)
        state = pending.host_state()
        assert all(torch.equal(t, dict(named)[n]) and torch.equal(state[n], t) for n, t in actor.named())
    table, pending = learner.pack(named, 4, None)  # a full-only version: nothing to encode
    assert pending.encode() == (None, None, None) and not pending.done.is_set()  # its file is still to come
    pending.discard()
    assert pending.done.is_set()


def test_the_next_pack_waits_for_the_delta_reading_its_buffer_and_a_discarded_one_frees_it():
    import threading

    learner = gpu_delta.PackedVersions()
    named = _named(1)
    learner.pack(named, 1, 0.5)[1].discard()
    _, pending = learner.pack(named, 2, 0.5)
    packed = threading.Event()
    t = threading.Thread(target=lambda: (learner.pack(named, 3, 0.5), packed.set()), daemon=True)
    t.start()
    assert not packed.wait(0.3)  # version 3 would overwrite version 1's buffer, which the delta reads
    assert pending.encode()[0] is not None
    assert not packed.wait(0.3)  # ... and version 2's file is still to be copied from its buffer
    pending.discard()  # version 2 superseded: its file is never written
    assert packed.wait(10)
    assert pending.encode() == (None, None, None)
    with pytest.raises(RuntimeError, match="discarded"):
        pending.host_state()
