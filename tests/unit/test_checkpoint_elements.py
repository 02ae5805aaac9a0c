"""weights.common.checkpoint_elements at the learner's start: a short or damaged safetensors file is
a one-line ConfigError naming the file and the fix, not a raw struct.error."""

import json
import struct

import pytest

from parley.errors import ConfigError
from parley.weights.common import checkpoint_elements


def _write(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_elements_counted_from_a_sound_header(tmp_path):
    _write(
        tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, b"\0" * 24
    )
    assert checkpoint_elements(tmp_path) == 6


@pytest.mark.parametrize("content", [b"", b"\x01\x02\x03", struct.pack("<Q", 1 << 40) + b"{}"])
def test_short_or_corrupt_file_is_one_line_error_naming_it(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        checkpoint_elements(tmp_path)
    msg = str(e.value)
    assert str(path) in msg and "re-download" in msg and "\n" not in msg
