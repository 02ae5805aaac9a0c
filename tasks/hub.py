"""What both kinds of Hugging Face Hub id share (models: engines/models.py; datasets: tasks/data.py):
the id's spelling, the offline switch and the quick "is there a network at all" test. In tasks/, the
lowest floor that reads Hub ids, because tasks/ may import neither engines/ nor runtime/."""

from __future__ import annotations

import os
import re

# A Hub id: "ORG/NAME", optionally "@REVISION" (a branch, tag or commit). An existing local path of the
# same spelling wins: "Qwen/Qwen3-0.6B" is a Hub id only where no such path exists here.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<rev>[A-Za-z0-9_./-]+))?$")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def first_line(e: BaseException) -> str:
    """An exception of huggingface_hub's (often many lines) as a short clause for a one-line error."""
    text = str(e).strip()
    return text.splitlines()[0].split(". ")[0][:160] if text else type(e).__name__


def unreachable() -> str:
    """Why the Hub cannot be reached at all ("" when its host resolves): a machine without a network is
    told at once, not after huggingface_hub's retries."""
    import socket
    import threading
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    answer: list[str] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(url.hostname or "", url.port or 443, type=socket.SOCK_STREAM)
            answer.append("")
        except OSError as e:
            answer.append(f"no network: {url.hostname} does not resolve ({e.strerror or e})")

    # a resolver without a network may take its whole timeout to say so; 3 s is plenty where one is
    t = threading.Thread(target=lookup, daemon=True)
    t.start()
    t.join(3.0)
    return answer[0] if answer else f"no network: {url.hostname} did not resolve within 3 s"
