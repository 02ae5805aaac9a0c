"""Test double base for learner.ranks.Driver: each of the Driver's typed calls is recorded by name
and answered by `__call__(name, *args)`, which a double overrides (or `DriverDouble.of(fn)` for a
plain function). Only the doubles name the calls as strings; the learner calls typed methods."""

from __future__ import annotations


class DriverDouble:
    def __call__(self, name: str, *args):
        return None

    @staticmethod
    def of(fn) -> DriverDouble:
        """A double whose calls all go to `fn(name, *args)`."""
        return _FunctionDouble(fn)

    def _call(self, name: str, *args):
        return self(name, *args)

    def train_step(self, samples):
        return self._call("train_step", samples)

    def warm_up(self):
        return self._call("warm_up")

    def save_checkpoint(self, ckpt_dir, tag):
        return self._call("save_checkpoint", ckpt_dir, tag)

    def load_checkpoint(self, ckpt_dir, tag):
        return self._call("load_checkpoint", ckpt_dir, tag)

    def weights_snapshot(self):
        return self._call("weights_snapshot")

    def adapter_snapshot(self):
        return self._call("adapter_snapshot")

    def pack_adapter(self, version):
        return self._call("pack_adapter", version)

    def pack_weights(self, version):
        return self._call("pack_weights", version)

    def pack_versions(self, version, max_share):
        return self._call("pack_versions", version, max_share)

    def weights_writable_in(self):
        return self._call("weights_writable_in")

    def stop(self):
        return self._call("stop")


class _FunctionDouble(DriverDouble):
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, name: str, *args):
        return self.fn(name, *args)
