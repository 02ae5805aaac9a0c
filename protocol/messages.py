"""Every message parley puts on the wire, as msgspec Structs encoded with msgpack.

Each Struct names its producer and consumer. Schema evolution follows msgspec's rules: new
fields go last and carry defaults; fields are never reordered, renamed or retyped.

Token arrays (ids, loss mask, behaviour log-probs) travel packed in bin fields; protocol.arrays
packs and reads them. Nothing else touches them.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

# vLLM samples greedily below this temperature (its _SAMPLING_EPS) and then returns the raw, untempered
# log-probs: no trained temperature may be below it (config.run.check_training, learner intake). At or
# above it, logits / temperature grow at most 1e5-fold: finite in every dtype the learner uses.
GREEDY_BELOW = 1e-5


class Sampling(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the policy samples: what the engine takes besides the prompt and the token budget. The
    one struct for it: [actor.sampling] (config.actor), the eval's settings (evaluation.runner) and
    the conversation loop read it; a Trajectory records both (Trajectory.temperature, .top_p).
    Training also needs temperature > 0 and top_p = 1 (config.run.check_training)."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, description="0 is greedy")] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0, description="1.0 keeps the whole distribution")] = 1.0


class ChatMessage(msgspec.Struct, frozen=True):
    """One chat message. Part of Task, Trajectory, EvalRecord and the service requests."""

    role: str  # "system" | "user" | "assistant"
    content: str


# What a Task may ask at most: beyond these it is no honest request, only a way to tie an actor up
# (the feeder's [rollout] config is held to the same bounds; actors dead-letter anything beyond).
TASK_MAX_N = 1024  # samples per group
TASK_MAX_NEW_TURNS = 1000  # messages added to a conversation
TASK_MAX_FUTURES = 64  # sampled futures per sample (next_turn)


class Task(msgspec.Struct, kw_only=True):
    """A prompt to sample n times. learner.feeder (and eval) -> actor."""

    task_id: str  # unique in the run; the GRPO group id
    run: str
    item_id: str  # dataset identity (conv_id/turn_id) for ledgers and leakage checks
    n: int  # samples (group size)
    mode: str = "conversation"  # "conversation" | "next_turn"
    prefix: list[ChatMessage] = []  # dataset conversation prefix; empty = the simulated user opens
    reference: str = ""  # the reference document the user has in mind
    title: str = ""
    summary: str = ""  # one-line goal, for the lazy_summary user
    system_prompt: str = ""  # assistant system prompt ("" = none)
    sim_prompt: str = "lazy_full"  # named user-simulator prompt variant
    max_new_turns: int = 6  # messages (user + assistant) added after the prefix
    max_tokens: int = 256  # per assistant turn
    futures: int = 0  # next_turn: k sampled futures for scoring
    future_turns: int = 2  # next_turn: w turns per future
    seed: int = 0
    admitted_version: int = 0  # policy version when the feeder admitted it
    split: str = "train"  # "train" | "eval"
    created: float = 0.0  # unix seconds


# Trajectory.terminated of a conversation its actor stopped (at a turn boundary, or with its running
# generation or simulator call cut and left out) because the learner can no longer train its group (stale_policy "drop":
# a turn of it, or of another sample of its task, lags the announced version by more than
# max_staleness). Published as far as it was played, passed on by the scorer unjudged (total 0, no
# metrics), and its group is dropped as stale by the learner: never trained.
ABANDONED_STALE = "stale"


# omit_defaults on the two hot, large Structs: defaults are not written; the decoder fills them back in.
class AssistantTurn(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One generated assistant turn inside a Trajectory."""

    start: int  # offset of the first generated token in the trajectory's token ids
    version: int  # policy version that generated this turn
    finish_reason: str  # "stop" | "length" | "abort"
    trained: bool = True  # next_turn mode trains only the first turn
    logprobs_f32: bytes = b""  # behaviour log-prob of each generated token, float32 LE; one per token
    # Prompt tokens whose KV older weights than `version` computed ([actor.engine]
    # prefix_cache_across_versions: earlier turns' KV kept across a swap): the behaviour log-probs are
    # then `version`'s over a prefix of older versions. 0: the whole prompt was this version's.
    stale_prefix_tokens: int = 0


class FutureRollout(msgspec.Struct, kw_only=True):
    """A sampled continuation after the trained turn (next_turn mode), scored only. Actors store the
    whole branch (the conversation up to and including the trained turn, then the continuation);
    rollout.score.future_messages takes the continuation's own messages from it."""

    messages: list[ChatMessage]
    assistant_tokens: int = 0


class SimCall(msgspec.Struct, kw_only=True):
    """One simulator call of a sample, as its answer came back (in the order asked; futures' after the
    main branch's): what `parley replay --deterministic` answers the same request with, found by `key`
    (rollout.conversation.sim_call_key of the SimRequest)."""

    key: str
    message: str
    done: bool = False
    fallback: bool = False


class Trajectory(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One finished sample of a Task. actor -> scorer (and replay, learner via Scored)."""

    traj_id: str  # f"{task_id}/{sample}"
    task_id: str
    sample: int
    run: str
    item_id: str
    messages: list[ChatMessage]
    turns: list[AssistantTurn]
    reference: str = ""
    prompt_tokens: int = 0  # tokens before the first assistant turn
    assistant_tokens: int = 0  # all generated assistant tokens (the token_amount metric)
    sim_fallbacks: list[int] = []  # indices into messages of user turns the simulator failed to produce
    # "sim_done" | "max_new_turns" | "max_model_len" | "abort" | ABANDONED_STALE
    terminated: str = ""
    futures: list[FutureRollout] = []
    mode: str = "conversation"
    sim_prompt: str = ""
    model: str = ""
    actor: str = ""
    seed: int = 0
    # the policy's sampling temperature (its Sampling's): the turns' log-probs are of
    # softmax(logits / temperature)
    temperature: float = 1.0
    timings: dict[str, float] = {}  # seconds: "generate", "sim", "total"
    created: float = 0.0
    # the whole conversation as the policy saw it (token-in/token-out), int32 LE
    token_ids_i32: bytes = b""
    loss_mask_u8: bytes = b""  # one uint8 per token: 1 on assistant-generated tokens that are trained
    # the policy's top-p (its Sampling's): below 1 the reported log-probs are renormalized over the
    # nucleus, which the learner does not recompute, so the learner refuses such a trajectory
    top_p: float = 1.0
    # the LoRA adapter that produced every turn ("" = whole weights): "<base identity>@<version>"
    adapter: str = ""
    # how many of `messages` came with the task (system prompt + dataset prefix); every user message
    # after them is a simulator answer. -1: not recorded (older actors)
    prefix_messages: int = -1
    # every simulator call's answer, for a deterministic replay (empty: older actors)
    sim_calls: list[SimCall] = []


class JudgeOutput(msgspec.Struct, kw_only=True):
    """The judge's raw reply for one operation, kept for audit and replay."""

    op: str  # "extract" | "interactivity"
    raw: str
    attempts: int = 1
    ok: bool = True
    error: str = ""
    # the request besides the op: the seed it was asked with, and which conversation of
    # rollout.score.conversations (0: the trajectory itself, k: future k) it judged. -1: not recorded
    seed: int = -1
    conversation: int = 0
    model: str = ""
    # the verdict as the scorer read it (JudgeReply's fields), so a replay can answer the same request
    # without the judge: the extracted document, the rubric levels, the score and the level distribution
    document: str = ""
    levels: dict[str, int] = {}
    score: float = 0.0
    distribution: dict[str, dict[str, float]] = {}


class Scored(msgspec.Struct, kw_only=True):
    """A trajectory with its reward. scorer -> learner (and eval, replay)."""

    traj_id: str
    task_id: str
    sample: int
    run: str
    metrics: dict[str, float]  # each reward component's metric (bleu, interactivity, token_amount)
    weights: dict[str, float]  # weight per metric used for the total
    total: float
    trajectory: Trajectory
    document: str = ""  # the document the judge extracted
    judge: list[JudgeOutput] = []
    judge_model: str = ""
    scorer: str = ""
    timings: dict[str, float] = {}  # seconds: "extract", "interactivity", "reference", "total"
    created: float = 0.0
    # [policy] reference = "service": the frozen initial policy's log-prob of each token given its
    # prefix, float32 LE, one per token of the trajectory (0.0 at token 0, which has no prefix); from
    # the reference service, asked by the scorer. Empty otherwise (and in older messages).
    ref_logp_f32: bytes = b""
    # metric -> [lo, hi] the total clamped it to before weighting ([scorer] clamps); with `weights`
    # the whole recipe of `total`, so a reader (the learner's per-term diagnostics, a replay) needs
    # no scorer configuration. Empty: no clamp (and in older messages).
    clamps: dict[str, list[float]] = {}
    # [scorer] audit_fraction: the same conversations judged a second time (by the audit judge, or the
    # same judge at another seed), for the judge's reliability; never part of `total`. Empty: not audited.
    audit: list[JudgeOutput] = []
    audit_metrics: dict[str, float] = {}  # the judge metrics the second verdict gives


class IpcTensor(msgspec.Struct, frozen=True, array_like=True):
    """One tensor inside a shared GPU buffer (transport "cuda_ipc"): its checkpoint name, dtype
    ("bfloat16", ...), shape, byte offset in the buffer and a checksum of its bytes computed on
    the GPU (weights.cuda_ipc.checksums). Part of CudaIpcBuffer."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    checksum: list[int]  # two int64 sums, see weights.cuda_ipc


class CudaIpcBuffer(msgspec.Struct, kw_only=True):
    """What an actor's vLLM worker needs to open the learner's GPU buffer: the fields of torch's
    CUDA IPC export (torch.multiprocessing.reductions.reduce_tensor) as plain values, the GPU by
    UUID (device indices differ between processes with other CUDA_VISIBLE_DEVICES) and the
    tensors laid out in it. learner -> actors, inside WeightVersion."""

    device_uuid: str
    storage_handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    nbytes: int  # bytes of the buffer's tensor (<= storage_size)
    hold_s: float  # the learner leaves the buffer untouched this long after filled_at: the reader's deadline
    tensors: list[IpcTensor] = []
    filled_at: float = (
        0.0  # wall-clock time the learner filled it (0: an older learner, hold counted from supersession)
    )


class NcclSource(msgspec.Struct, kw_only=True):
    """Where an actor's vLLM worker fetches a version by transport "nccl": it joins the learner
    rank 0's store at `address`, gets a two-rank process group of its own, asks for the version
    and receives the packed buffer (the CudaIpcBuffer layout) into its GPU memory. learner ->
    actors, inside WeightVersion."""

    address: str  # host:port of rank 0's TCPStore, reachable from the actors
    backend: str  # "nccl" on GPUs; "gloo" where the learner has none (CPU runs, CI)
    nbytes: int
    hold_s: float  # as CudaIpcBuffer.hold_s: the learner leaves a filled buffer unchanged this long
    tensors: list[IpcTensor] = []
    # The sender's store, one per learner process (128 random bits): another one (a restarted learner,
    # maybe at the same address) makes a receiver join again. It is also the join secret: a join proves
    # it read this announcement (weights.nccl), so only a process with the run's bus rights can join.
    # An announcement without it is refused.
    instance: str = ""


class WeightDelta(msgspec.Struct, kw_only=True):
    """A file-transport version also sent as the values changed since a base version.
    learner -> actors, inside WeightVersion.delta; an actor serving the base may apply it instead of
    fetching the full file. format "file" (weights.delta): over the safetensors file, the result
    served only if its sha256 is WeightVersion.sha256; "packed" (weights.gpu_delta): over the
    version's packed tensors (WeightVersion.packed), built on the learner's GPU and applied to the
    actor's packed copy of the weights it serves, the result served only if its checksums are
    WeightVersion.packed's."""

    base_version: int
    # "file": sha256 of the base's safetensors file; "packed": the table digest of the base's packed
    # tensors (weights.cuda_ipc.table_digest). The actor must serve exactly that.
    base_sha256: str
    location: str  # object name or file path of the delta, beside the full version's files
    sha256: str  # of the delta file
    bytes: int
    format: str = "file"


class LoraAdapter(msgspec.Struct, kw_only=True):
    """A version that is a LoRA adapter on a frozen base, not whole weights ([learner.lora]): the
    blob (location, sha256, bytes) or the GPU buffer (cuda_ipc) holds only the adapter's tensors, its
    peft config among the files or in `config`.
    learner -> actors, inside WeightVersion.adapter; an actor whose base is not `base` refuses it."""

    base: str  # the base model's identity (weights.lora.base_identity): config and weight files
    rank: int  # the adapter's LoRA rank; the actor's engine must allow at least this (max_lora_rank)
    # the peft config (adapter_config.json's JSON) when the adapter travels in GPU memory (cuda_ipc),
    # where no file goes with it; "" for the file transports, which carry it among their files
    config: str = ""


class WeightVersion(msgspec.Struct, kw_only=True):
    """Announcement of new policy weights. learner -> actors (KV key "current", and history)."""

    version: int
    step: int
    transport: str  # a kind of weights.registry: "objstore" | "shared_dir" | "cuda_ipc" | "nccl"
    location: str  # object name, directory path, "cuda:<GPU uuid>" (cuda_ipc) or "nccl://host:port"
    sha256: str  # of the safetensors file; cuda_ipc, nccl: of the tensor table with its checksums
    bytes: int
    created: float
    run: str = ""
    files: list[str] = []  # extra files (config.json) beside the safetensors blob
    ipc: CudaIpcBuffer | None = None  # transport "cuda_ipc" only
    nccl: NcclSource | None = None  # transport "nccl" only
    # objstore, shared_dir: the same version as a delta against a base. location/sha256/bytes above
    # always describe a full copy, stored before WEIGHTS_KEY names the version: an actor that predates
    # this field (or lacks the base) fetches that, never the delta.
    delta: WeightDelta | None = None
    # True only on topology.WEIGHTS_EARLY_KEY: the full copy at location is still being uploaded; an
    # actor without the delta's base waits for it (weights.registry.fetch_version, bounded).
    full_pending: bool = False
    # a LoRA adapter on the base (LoraAdapter); None: whole weights
    adapter: LoraAdapter | None = None
    # objstore, shared_dir with [weights] delta_format = "packed": the version's tensors in the packed
    # layout (offsets, checksums; weights.cuda_ipc) that its packed delta rebuilds and that an actor
    # keeping a packed copy of what it serves checks it against. [] otherwise.
    packed: list[IpcTensor] = []
    # sha256 (hex) of each of `files`, in order, of the whole file: an actor refuses a version whose
    # extra file (config.json, adapter_config.json) differs or has none (weights.common.extra_digests)
    file_sha256: list[str] = []


class EvalRecord(msgspec.Struct, kw_only=True):
    """One benchmark conversation with all that re-scoring needs. eval -> EVAL stream, replay."""

    eval_id: str
    condition: str
    item_id: str
    model: str
    system_prompt: str
    sim_prompt: str
    sim_model: str
    judge_model: str
    seed: int
    messages: list[ChatMessage]
    reference: str
    assistant_tokens: int
    metrics: dict[str, float] = {}
    document: str = ""
    judge: list[JudgeOutput] = []
    version: int = -1
    created: float = 0.0


class SimRequest(msgspec.Struct, kw_only=True):
    """actor -> sim service (request/reply): produce the user's next message."""

    prompt: str  # named prompt variant
    messages: list[ChatMessage]  # the conversation so far, from the assistant's point of view
    reference: str = ""
    title: str = ""
    summary: str = ""
    seed: int = 0
    max_tokens: int = 256


class SimReply(msgspec.Struct, kw_only=True):
    """sim service -> actor."""

    message: str
    done: bool = False
    fallback: bool = False  # the simulator's output was unusable; this is a stand-in
    attempts: int = 1
    error: str = ""
    model: str = ""


class JudgeRequest(msgspec.Struct, kw_only=True):
    """scorer -> judge service (request/reply); op is in the subject and repeated here."""

    op: str  # one of topology.JUDGE_OPS
    messages: list[ChatMessage]
    seed: int = 0
    # the first attempt's sampling temperature; -1: the service's own ([judge] temperature). The
    # scorer's second verdicts ([scorer] audit_temperature) sample where the judge is greedy.
    temperature: float = -1.0


class JudgeReply(msgspec.Struct, kw_only=True):
    """judge service -> scorer. ok=False is a failure to be retried, never a score of 0."""

    ok: bool
    document: str = ""
    levels: dict[str, int] = {}  # interactivity rubric levels 0..3
    score: float = 0.0  # interactivity 0..1 (interactivity_3level: 0, 0.5 or 1)
    raw: str = ""
    attempts: int = 1
    error: str = ""
    model: str = ""
    # interactivity_expected: per rubric criterion, the judge's probability of each level ("0".."3")
    # at the token where it wrote that level; score is the expected rating under it.
    distribution: dict[str, dict[str, float]] = {}


class ReferenceRequest(msgspec.Struct, kw_only=True):
    """scorer -> reference service (request/reply): score a trajectory's tokens under the frozen
    initial policy. `model` is [policy] model as the learner names it; the service answers only for
    the model it holds, at version 0 (the initial weights)."""

    model: str
    token_ids_i32: bytes  # (T,) int32 LE, protocol.arrays.pack_ids
    version: int = 0


class ReferenceReply(msgspec.Struct, kw_only=True):
    """reference service -> scorer. ok=False is a failure (the request asked for what this service
    cannot answer), never a log-prob."""

    ok: bool
    logp_f32: bytes = b""  # (T-1,) float32 LE: the log-prob of tokens 1..T-1, each given its prefix
    error: str = ""
    model: str = ""


class DeadLetter(msgspec.Struct, kw_only=True):
    """A message that could not be handled. any consumer -> DEAD stream."""

    subject: str  # where the original came from
    reason: str
    consumer: str
    payload: bytes  # the original bytes, untouched
    created: float = 0.0


class Heartbeat(msgspec.Struct, kw_only=True):
    """Role status for the live view. every role -> parley.<run>.status.<role>.<id>."""

    role: str
    id: str
    state: str  # "starting" | "ready" | "busy" | "stopping"
    version: int = -1
    counters: dict[str, float] = {}
    created: float = 0.0


class BudgetUpdate(msgspec.Struct, kw_only=True):
    """An operator's new simulator and judge call limits for a run (`parley auth budget`), as run totals
    like [rollout] sim_call_budget etc.: each actor and scorer takes its share (services.budget). None
    leaves a limit as it is; 0 makes it unlimited. admin -> parley.<run>.control.budget -> actors
    (simulator) and scorers (judge), core NATS (not stored); only the admin user may publish there."""

    sim_call_budget: Annotated[int, msgspec.Meta(ge=0)] | None = None
    judge_call_budget: Annotated[int, msgspec.Meta(ge=0)] | None = None
    sim_calls_per_s: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    judge_calls_per_s: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    created: float = 0.0
