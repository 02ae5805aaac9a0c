"""One tree of errors: every exception parley raises on purpose derives from `ParleyError`, through
a child that says what went wrong, so a caller can catch by meaning (`except Unavailable:` asks
again later) and the command line turns any of them into one line and an exit code
(deploy/cli.py). Each child keeps the builtin base its classes always had (a ConfigError is still
a ValueError), so no `except ValueError` elsewhere catches more or less than before.

This module sits below every package, protocol/ included, and imports nothing
(tests/unit/test_layout.py); tests/unit/test_errors.py checks that every exception class of the
project derives from ParleyError.
"""

from __future__ import annotations


class ParleyError(Exception):
    """The root. `exit_code` is what a `parley` command exits with when one escapes it."""

    exit_code = 1


class ConfigError(ParleyError, ValueError):
    """Bad input the user gave: a config key or value, a model, a data file, a plan that cannot
    fit. The message is one line naming the value and the fix."""

    exit_code = 2


class BadMessage(ParleyError, ValueError):
    """A message, request or record that breaks the contract it claims (does not decode, wrong
    shape, impossible values): asking again with the same bytes cannot help."""


class ProtocolError(ParleyError):
    """The bus's own verdicts on a message it could not handle (protocol.bus.Poison, Retry) and
    blobs that fail their integrity check."""


class Unavailable(ParleyError):
    """Something needed is not reachable now (NATS, a service, a weights blob); asking again later
    may succeed."""

    exit_code = 3


class Refused(ParleyError):
    """A peer answered but could not give a usable result (a judge without a verdict, a reference
    without log-probs, a backend that failed)."""


class StateError(ParleyError, RuntimeError):
    """Stored or shared state is not what it must be (the ledger, a lease, a stream's topology, a
    weights version): it needs a person or a restart, not a retry."""

    exit_code = 4
