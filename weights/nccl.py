"""The `nccl` weight transport between the learner's rank 0 and actors on other GPUs or hosts.

Rank 0 runs a TCPStore at [weights] address. An actor's vLLM worker joins it once: it takes a
number k from the store and proves it read the announcement (`join_proof`: an HMAC of k and its
name keyed with the announced NcclSource.instance, which only a reader of the run's NATS-protected
weights KV knows; the store, open to anyone who reaches the port, sees the proof, never the key,
and a proof is good for its own k only); rank 0 admits it (`actor<k>/admit` = "ok" or why not) and
both sides build a two-rank process group of their own (rank 0 = the learner, rank 1 = this worker)
under the store prefix `actor<k>`; no global process group, so actors join and leave without
touching the learner's training group. Joins are bounded: at most `max_joining` groups being built
at once and `max_actors` served, a join's group built and its first request made within
JOIN_TIMEOUT_S, and a joined worker beats (`beat`, every BEAT_S) so that rank 0 drops the group of
one that died within `dead_s` rather than hold its thread and communicator until idle_s. Per version the worker
asks (`req<n>` = version), rank 0 answers (`ack<n>` = "ok" or why not) and sends the packed buffer
(weights.cuda_ipc's layout, the same per-tensor checksums) which the worker receives into its
own memory, checks, and only then loads. Every wait has a timeout on the host (finish: NCCL's
wait() alone does not block): a store wait, a send or a receive that exceeds it drops that actor's
group (the actor joins again for its next version), and a sent buffer is given back to the
publisher only once its send has finished (send_held).
The backend is NCCL on GPUs and gloo where the learner has none (CPU runs and the tests).

NcclSender runs on rank 0 (learner.trainer builds it through weights.registry); Receiver in
engines.engine's WorkerExtension (through `Nccl.receive`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import TYPE_CHECKING

from parley.protocol.messages import NcclSource, WeightVersion
from parley.weights.common import Transport, WeightUnavailable
from parley.weights.cuda_ipc import IpcPublisher, checksums, mismatch, views

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 60.0  # a join: admitted, its group built by both sides and its first request made within this
BEAT_S = 5.0  # a joined worker adds to its `beat` key this often, while it keeps its group
DEAD_S = 30.0  # rank 0 drops the group of a worker whose beat has not moved for this long (it died)
MAX_JOINING = 4  # groups being built at once; a join beyond them is refused (the worker asks again later)
MAX_ACTORS = 64  # workers served at once (a thread and a communicator each on the training GPU)


def join_proof(secret: str, k: int, name: str) -> str:
    """What join number `k` of worker `name` writes to show it knows the announced secret."""
    return hmac.new(secret.encode(), f"join:{k}:{name}".encode(), hashlib.sha256).hexdigest()


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"nccl address {address!r} is not host:port; set [weights] address (e.g. 10.0.0.1:29600)")
    return host, int(port)


def store_wait(store, key: str, timeout_s: float) -> bool:
    """Wait for `key` in the store: True when it is there, False after timeout_s."""
    import torch.distributed as dist

    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return True
    except (dist.DistStoreError, RuntimeError) as e:  # the store's timeout; anything else propagates
        if "timeout" not in str(e).lower() and not isinstance(e, dist.DistStoreError):
            raise
        return False


def finish(work, timeout_s: float, what: str) -> None:
    """Return once `work` (a send or receive) has completed, as seen from the host; TimeoutError past
    timeout_s. gloo's wait() blocks until then (or raises past its timeout); NCCL's, without blocking
    wait (TORCH_NCCL_BLOCKING_WAIT, off by default), only orders the current stream behind the work
    and returns at once, so the host polls is_completed() (the work's end event) up to the deadline:
    a buffer is never given back, nor a received one read, while the transfer may still run."""
    deadline = time.monotonic() + timeout_s
    work.wait(timedelta_s(timeout_s))
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not finish in {timeout_s:.0f} s")
        time.sleep(0.0005)


def abort(group) -> bool:
    """Abort `group`'s communicator (NCCL: its pending kernels end), so a transfer that timed out no
    longer touches its buffer. False where the group cannot be aborted."""
    stop = getattr(group, "abort", None)
    if stop is None:
        return False
    try:
        stop()
    except Exception as e:  # noqa: BLE001 - treated as not aborted: the buffer stays taken
        log.warning("weights: aborting a timed-out nccl group failed: %s", e)
        return False
    return True


def send_held(pub: IpcPublisher, buf, group, n: int, timeout_s: float) -> None:
    """Send a taken buffer (IpcPublisher.take) to rank 1 and release it once the send has finished
    (finish). A send that timed out releases it only once its group is aborted; else the buffer stays
    taken (never refilled: one buffer fewer) rather than be overwritten while it may still be read."""
    try:
        finish(group.send([buf.data], 1, n), timeout_s, f"sending request {n}")
    except TimeoutError:
        if abort(group):
            pub.release(buf)
        else:
            log.error("weights: a send timed out and its group cannot be aborted; its buffer stays taken")
        raise
    except BaseException:
        pub.release(buf)  # the send failed: nothing in flight reads the buffer
        raise
    pub.release(buf)


def pair_group(store, rank: int, backend: str, timeout_s: float):
    """A two-rank process group (0 = learner, 1 = actor worker) on `store`, outside any global group."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
    if backend != "nccl":
        raise ValueError(f"nccl backend {backend!r} not known; use nccl or gloo")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


class Receiver:
    """The actor worker's side: joined lazily on the first version, kept while it works."""

    def __init__(self, name: str):
        self.name = name
        self.address = self.instance = ""
        self.store = None  # this actor's PrefixStore
        self.group = None
        self.n = 0  # the next request number
        self._beating: threading.Event | None = None  # set to stop the beat of the group joined last

    def _current(self, source: NcclSource) -> bool:
        """Whether the joined group can serve `source`: the same learner store (address and instance),
        still reachable, and the sender has not dropped us (an actor silent for its idle_s: `dropped`)."""
        if self.group is None or (self.address, self.instance) != (source.address, source.instance):
            return False
        try:
            return not self.store.check(["dropped"])
        except (RuntimeError, TimeoutError):  # the store is gone (the learner restarted) or unreachable
            return False

    def _join(self, source: NcclSource) -> None:
        import torch.distributed as dist

        self._stop_beat()
        if not source.instance:
            raise RuntimeError(
                f"the learner at {source.address} announces no join secret (NcclSource.instance): it runs "
                "an older parley; run the learner and the actors of one version"
            )
        host, port = parse_address(source.address)
        root = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        k = root.add("joins", 1)
        root.set(f"join{k}", json.dumps({"name": self.name, "proof": join_proof(source.instance, k, self.name)}))
        store = dist.PrefixStore(f"actor{k}", root)  # keys "actor<k>/<key>"
        if not store_wait(store, "admit", JOIN_TIMEOUT_S):
            raise TimeoutError(f"the learner at {source.address} did not admit join {k} in {JOIN_TIMEOUT_S:.0f} s")
        admit = store.get("admit").decode()
        if admit != "ok":
            raise RuntimeError(f"the learner at {source.address} refused join {k}: {admit}")
        self.store = store
        self.group = pair_group(self.store, 1, source.backend, JOIN_TIMEOUT_S)
        self.address, self.instance, self.n = source.address, source.instance, 0
        self._beating = threading.Event()
        threading.Thread(target=beat, args=(host, port, k, self._beating), name=f"nccl-beat{k}", daemon=True).start()
        log.info("joined the learner's weight sender at %s as actor %d", source.address, k)

    def _stop_beat(self) -> None:
        if self._beating is not None:
            self._beating.set()
            self._beating = None

    def fetch(self, source: NcclSource, version: int, device) -> tuple[list[tuple[str, Tensor]], str | None]:
        """(name, tensor) views into a received and checked copy of `version`, or ([], reason).
        Raises (and forgets the group, so the next call joins again) when the transfer breaks."""
        import torch

        if not self._current(source):  # a new learner, a broken group, or dropped for idling: join again
            self.group = None
            self._join(source)
        n, self.n = self.n, self.n + 1
        try:
            self.store.set(f"req{n}", str(version))
            if not store_wait(self.store, f"ack{n}", source.hold_s):
                raise TimeoutError(
                    f"the learner did not answer the request for version {version} in {source.hold_s:.0f} s"
                )
            ack = self.store.get(f"ack{n}").decode()
            if ack != "ok":
                return [], ack
            staged = torch.empty(source.nbytes, dtype=torch.uint8, device=device)
            finish(self.group.recv([staged], 0, n), source.hold_s, f"receiving version {version}")
        except BaseException as e:
            if isinstance(e, TimeoutError):
                abort(self.group)  # the receive may still be writing `staged`: stop it before it is freed
            self.group = None
            self._stop_beat()
            raise
        reason = mismatch(source.tensors, checksums(staged, source.tensors))
        if reason:
            return [], reason
        return list(zip([e.name for e in source.tensors], views(staged, source.tensors))), None


def beat(host: str, port: int, k: int, stop: threading.Event) -> None:
    """A joined worker's heartbeat (a thread of its own, on a store connection of its own): adds to
    `actor<k>/beat` every BEAT_S until `stop`. When the worker dies, so does its beat, and rank 0
    drops its group (NcclSender: dead_s)."""
    import torch.distributed as dist

    try:
        store = dist.PrefixStore(
            f"actor{k}", dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        )
        while True:
            store.add("beat", 1)
            if stop.wait(BEAT_S):
                return
    except (RuntimeError, TimeoutError) as e:  # the store is gone (the learner stopped): nothing to beat for
        log.debug("nccl beat of join %d stopped: %s", k, e)


class NcclSender:
    """Rank 0's side of transport nccl (this module): a TCPStore at `address`, a thread that
    accepts actors as they join, and one thread per actor that answers its requests from the
    publisher's held buffers over that actor's own two-rank group. The training loop only fills
    buffers (pack); sends happen beside it and never wait on it. A join without the proof of the
    announced secret is refused, so is one beyond `max_joining` groups being built or `max_actors`
    served (this module's docstring). An actor whose send fails or times out is dropped (it joins
    again for its next version); one whose beat stopped for `dead_s` (it died), one that made no
    first request within JOIN_TIMEOUT_S, and one silent for `idle_s` too. The threads block in store
    waits (slices of dead_s); close() wakes each with a stop marker."""

    def __init__(
        self,
        publisher: IpcPublisher,
        address: str,
        backend: str,
        timeout_s: float,
        idle_s: float = 3600.0,
        *,
        dead_s: float | None = None,
        max_joining: int | None = None,
        max_actors: int | None = None,
    ):
        import torch
        import torch.distributed as dist

        host, port = parse_address(address)
        self.pub, self.address, self.backend = publisher, address, backend
        self.timeout_s, self.idle_s = timeout_s, idle_s
        # None: this module's bounds (DEAD_S, MAX_JOINING, MAX_ACTORS) as they are when the sender is built
        self.dead_s = DEAD_S if dead_s is None else dead_s
        self.max_joining = MAX_JOINING if max_joining is None else max_joining
        self.max_actors = MAX_ACTORS if max_actors is None else max_actors
        # Announced (NcclSource.instance) in the NATS-protected weights KV: the join secret (join_proof),
        # and receivers of an older store see another one and join again.
        self.instance = secrets.token_hex(16)
        self.device = torch.cuda.current_device() if backend == "nccl" else None
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta_s(timeout_s))
        # A blocked wait holds its store connection: each thread waits on a connection of its own.
        self._connect = lambda: dist.TCPStore(host, port, is_master=False, timeout=timedelta_s(timeout_s))
        self.actors: dict[int, str] = {}  # joined actor number -> its name, while served
        self.joining = 0  # admitted joins whose group is being built
        self.counters: Counter[str] = Counter()  # joins admitted, refused (with why); groups dropped
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next_join = 1  # the join key the accept thread waits for
        self._next_req: dict[int, int] = {}  # actor number -> the request key its thread waits for
        self._threads = [threading.Thread(target=self._accept, name="nccl-accept", daemon=True)]
        self._threads[0].start()

    def pack(self, named: list[tuple[str, Tensor]], version: int, finish=None):
        """Fill a held buffer with `version`: the protocol.messages.NcclSource to announce, or None
        when every buffer is still held (IpcPublisher.fill: the version is not published; `finish`
        as there)."""
        filled = self.pub.fill(named, version, finish)
        if filled is None:
            return None
        _, tensors = filled
        return NcclSource(
            address=self.address,
            backend=self.backend,
            nbytes=self.pub.total,
            hold_s=self.pub.hold_s,
            tensors=tensors,
            instance=self.instance,
        )

    def writable_in(self) -> float:
        """IpcPublisher.writable_in of the buffers it sends from."""
        return self.pub.writable_in()

    def close(self) -> None:
        """Stop accepting and serving: every waiting thread is woken by its stop marker and joined."""
        self._stop.set()
        with self._lock:
            self.store.set(f"join{self._next_join}", "")
            for k, n in self._next_req.items():
                self.store.set(f"actor{k}/req{n}", "stop")
        for t in self._threads:
            t.join(timeout=self.timeout_s)
        self.store = None  # the server goes with it: a new sender (a restarted learner) may take the address

    def _accept(self) -> None:
        store = self._connect()
        k = 1
        while True:
            store.wait([f"join{k}"], timedelta_s(1e6))  # close() sets a stop marker
            raw = store.get(f"join{k}")
            with self._lock:
                if self._stop.is_set():
                    return
                self._next_join = k + 1
                name, why = self._admit(k, raw)
                if not why:
                    self.joining += 1
                    t = threading.Thread(target=self._serve, args=(k, name), name=f"nccl-actor{k}", daemon=True)
                    self._threads.append(t)
            if why:
                self.counters["refused"] += 1
                log.warning("weights: refused nccl join %d (%s): %s", k, name or "?", why)
                store.set(f"actor{k}/admit", why)
            else:
                self.counters["admitted"] += 1
                store.set(f"actor{k}/admit", "ok")
                t.start()
            k += 1

    def _admit(self, k: int, raw: bytes) -> tuple[str, str]:
        """(the joining worker's name, "" to admit join `k` or why it is refused). Under self._lock."""
        try:
            join = json.loads(raw)
            name, proof = join["name"], join["proof"]
            if not (isinstance(name, str) and isinstance(proof, str)):
                raise TypeError("name and proof are strings")
        except (ValueError, TypeError, KeyError) as e:
            return "", f"not a join of this parley ({type(e).__name__}: {str(e)[:100]}); the actors run another version"
        name = name[:200]
        if not hmac.compare_digest(proof, join_proof(self.instance, k, name)):
            return name, "wrong proof: the joining process has not read this learner's announcement"
        if self.joining >= self.max_joining:
            return name, f"{self.joining} joins under way (at most {self.max_joining}); ask again later"
        if len(self.actors) + self.joining >= self.max_actors:
            return name, f"{len(self.actors)} actors served (at most {self.max_actors}); ask again later"
        return name, ""

    def _wait_request(self, store, n: int) -> bool:
        """Wait for request `n` in slices of dead_s: True when it came; TimeoutError when the worker's
        beat stopped (it died), when a join made no first request within JOIN_TIMEOUT_S, or after
        idle_s without a request."""
        limit = JOIN_TIMEOUT_S if n == 0 else self.idle_s
        deadline = time.monotonic() + limit
        seen = store.add("beat", 0)
        while not store_wait(store, f"req{n}", min(self.dead_s, max(deadline - time.monotonic(), 0.0))):
            now = store.add("beat", 0)
            if time.monotonic() >= deadline:
                what = "first request" if n == 0 else "request"
                raise TimeoutError(f"no {what} for {limit:.0f} s")
            if now == seen:
                raise TimeoutError(f"no beat for {self.dead_s:.0f} s: the worker died")
            seen = now
        return True

    def _serve(self, k: int, name: str) -> None:
        import torch
        import torch.distributed as dist

        if self.device is not None:
            torch.cuda.set_device(self.device)  # per thread
        try:
            store = dist.PrefixStore(f"actor{k}", self._connect())  # keys "actor<k>/<key>"
            group = pair_group(store, 0, self.backend, JOIN_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - that actor never completed its join; the others go on
            log.warning("weights: actor %d (%s) did not complete its join: %s", k, name, e)
            return
        finally:
            with self._lock:
                self.joining -= 1
        self.actors[k] = name
        log.info("weights: actor %d (%s) joined the nccl sender", k, name)
        n = 0
        try:
            while True:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._next_req[k] = n
                # Blocks until the actor asks (or close() marks stop); an actor that died, or silent
                # for idle_s, is dropped and joins again when it next asks.
                self._wait_request(store, n)
                req = store.get(f"req{n}").decode()
                if req == "stop":
                    return
                version = int(req)
                buf = self.pub.take(version)
                if buf is None:
                    store.set(
                        f"ack{n}",
                        f"version {version} is no longer held (its buffer was refilled "
                        f"over {self.pub.hold_s:.0f} s after it was filled); the next one will be",
                    )
                else:
                    try:
                        store.set(f"ack{n}", "ok")
                    except BaseException:
                        self.pub.release(buf)
                        raise
                    send_held(self.pub, buf, group, n, self.timeout_s)
                n += 1
        except Exception as e:  # noqa: BLE001 - that actor is dropped; it joins again for its next version
            log.warning("weights: actor %d (%s) dropped from the nccl sender: %s", k, name, e)
            self.counters["dropped"] += 1
            try:  # tells the actor to join again (Receiver._current) rather than ask a thread that is gone
                store.set("dropped", str(e))
            except Exception:  # noqa: BLE001 - the store itself broke: the actor finds it gone
                pass
        finally:
            self.actors.pop(k, None)
            with self._lock:
                self._next_req.pop(k, None)


def timedelta_s(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


class Nccl(Transport):
    kind = "nccl"
    gpu = True
    carries_adapters = False  # adapters over nccl are not built: objstore, shared_dir or cuda_ipc
    receives_copy = True  # received into the actor's own buffer, then loaded
    source_type = NcclSource

    def sender(self, settings, device) -> NcclSender:
        return NcclSender(
            IpcPublisher(settings.hold_s, settings.max_buffers),
            settings.address,
            "nccl" if device.type == "cuda" else "gloo",
            timeout_s=settings.hold_s,
        )

    def announcement(self, source: NcclSource, **common) -> WeightVersion:
        return WeightVersion(transport=self.kind, location=f"nccl://{source.address}", nccl=source, **common)

    def source(self, wv: WeightVersion) -> NcclSource | None:
        return wv.nccl

    def receive(self, wv: WeightVersion, state: dict, own: bool = False):
        # own needs nothing more here: every fetch receives into a buffer of its own (Receiver.fetch)
        import os

        import torch

        if "nccl" not in state:  # one receiver per worker: its group is kept while it works
            state["nccl"] = Receiver(f"{os.uname().nodename}-{os.getpid()}")
        device = torch.device("cuda", torch.cuda.current_device()) if wv.nccl.backend == "nccl" else torch.device("cpu")
        try:
            return state["nccl"].fetch(wv.nccl, wv.version, device)
        except (RuntimeError, TimeoutError) as e:  # the learner is gone, the transfer broke, out of memory
            raise WeightUnavailable(f"receiving from {wv.nccl.address} failed: {e}") from e  # rejoins next time
