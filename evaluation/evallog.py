"""The eval log: EvalRecords (and Scored trajectories) in Parquet or JSONL, read back exactly; training
trajectories turned into EvalRecords; and the re-scoring that needs no judge (the environment's pure
metrics recomputed, CollabLLM's BLEU from the stored document, stored interactivity, new weights). Used by `parley eval`, `parley replay` and evaluation.selection.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import numpy as np

from parley.environments.base import Environment, PureMetric
from parley.protocol.arrays import IDS, LOGPROBS, MASK
from parley.protocol.messages import ABANDONED_STALE, EvalRecord, JudgeReply, Scored
from parley.rewards.metrics import BLEU_VARIANTS, INTERACTIVITY_SCALES
from parley.rewards.reward import total_reward

# Which Struct a Parquet file holds, in the file's schema metadata, so a reader never guesses.
_TYPE_KEY = b"parley.type"
_LOG_TYPES: dict[str, type] = {"EvalRecord": EvalRecord, "Scored": Scored}
# Columns whose type has no natural Arrow form are stored as msgspec JSON text (exact for floats too).
_JSON_KEY = b"parley.encoding"

# The wire's packed little-endian arrays (protocol.arrays) as Arrow list columns any Parquet reader
# (duckdb, pandas, polars) reads as numbers: struct name -> {wire field: (column, dtype)}. Each column
# is named for what it holds, without the wire's dtype suffix.
_LISTS = {
    "Trajectory": {"token_ids_i32": ("token_ids", IDS), "loss_mask_u8": ("loss_mask", MASK)},
    "AssistantTurn": {"logprobs_f32": ("logprobs", LOGPROBS)},
    "Scored": {"ref_logp_f32": ("ref_logprobs", LOGPROBS)},
}
# Column names that say what a field holds outside the Struct's context.
_RENAMED = {"Scored": {"weights": "reward_weights"}}


@functools.cache  # per Struct type: read and written once per nested Struct of every row
def _columns(cls: type) -> tuple:
    """(field, column, dtype) for each stored field of a Struct: dtype is the packed array's element
    type for a field stored as an Arrow list, else None."""
    arrays = _LISTS.get(cls.__name__, {})
    renamed = _RENAMED.get(cls.__name__, {})
    out = []
    for f in mi.type_info(cls).fields:
        if f.encode_name in arrays:
            out.append((f, *arrays[f.encode_name]))
        else:
            out.append((f, renamed.get(f.encode_name, f.encode_name), None))
    return tuple(out)


def _to_columns(value, t):
    """A to_builtins value laid out as the archive stores it: packed arrays unpacked into lists,
    fields renamed."""
    match t:
        case mi.ListType(item_type=it):
            return [_to_columns(v, it) for v in value]
        case mi.DictType(value_type=vt):
            return {k: _to_columns(v, vt) for k, v in value.items()}
        case mi.StructType(cls=cls):
            out = {}
            for f, column, dtype in _columns(cls):
                if dtype is not None:
                    packed = value.get(f.encode_name)
                    out[column] = np.frombuffer(packed, dtype) if packed else []
                elif f.encode_name in value:
                    out[column] = _to_columns(value[f.encode_name], f.type)
            return out
    return value


def _arrow_type(t):
    """Arrow type of a msgspec type, or None when the value is stored as JSON text instead."""
    import pyarrow as pa

    match t:
        case mi.StrType():
            return pa.string()
        case mi.BoolType():
            return pa.bool_()
        case mi.IntType():
            return pa.int64()
        case mi.FloatType():
            return pa.float64()
        case mi.BytesType():
            return pa.binary()
        case mi.ListType(item_type=item):
            inner = _arrow_type(item)
            return None if inner is None else pa.list_(inner)
        case mi.DictType(key_type=mi.StrType(), value_type=value):
            inner = _arrow_type(value)
            return None if inner is None else pa.map_(pa.string(), inner)
        case mi.StructType(cls=cls):
            inner = [
                (column, _arrow_type(f.type) if dtype is None else _list_type(dtype))
                for f, column, dtype in _columns(cls)
            ]
            return None if any(a is None for _, a in inner) else pa.struct(inner)
    return None


def _list_type(dtype: np.dtype):
    import pyarrow as pa

    return pa.list_(pa.from_numpy_dtype(dtype))


def _schema(cls: type):
    import pyarrow as pa

    fields = []
    for f, column, dtype in _columns(cls):
        arrow = _arrow_type(f.type) if dtype is None else _list_type(dtype)
        fields.append(
            pa.field(column, pa.string(), metadata={_JSON_KEY: b"json"}) if arrow is None else pa.field(column, arrow)
        )
    return pa.schema(fields, metadata={_TYPE_KEY: cls.__name__.encode()})


def _field_value(value, t, dtype):
    """One stored column's value as its Struct field takes it: a list column packed again."""
    if dtype is not None:
        return np.asarray(value, dtype=dtype).tobytes()
    return _maps_to_dicts(value, t)


def _maps_to_dicts(value, t):
    """Arrow hands maps back as lists of (key, value) pairs; turn them into dicts, recursively, and
    structs back into their fields (the archive's layout, see _columns)."""
    match t:
        case mi.DictType(value_type=vt):
            return {k: _maps_to_dicts(v, vt) for k, v in value}
        case mi.ListType(item_type=it):
            return [_maps_to_dicts(v, it) for v in value]
        case mi.StructType(cls=cls):
            # null: a field the writer omitted (omit_defaults Structs); msgspec.convert fills its default;
            # an empty list column: the packed field's default (b"")
            return {
                f.encode_name: _field_value(value[column], f.type, dtype)
                for f, column, dtype in _columns(cls)
                if value.get(column) is not None and (dtype is None or len(value[column]))
            }
    return value


def write_parquet(records: Sequence[msgspec.Struct], path: str | Path) -> Path:
    """Write EvalRecords (or Scored) to one Parquet file; read_records gives back equal objects."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not records:
        raise ValueError(f"no records to write to {path}")
    cls = type(records[0])
    if cls.__name__ not in _LOG_TYPES or any(type(r) is not cls for r in records):
        raise TypeError(
            f"write_parquet takes a list of one of {sorted(_LOG_TYPES)}, got {sorted({type(r).__name__ for r in records})}"
        )
    schema = _schema(cls)
    # bytes stay bytes for Arrow's binary columns (to_builtins would write them as base64 text)
    struct = mi.type_info(cls)
    rows = [_to_columns(row, struct) for row in msgspec.to_builtins(list(records), builtin_types=(bytes,))]
    for field in schema:
        if field.metadata and field.metadata.get(_JSON_KEY) == b"json":
            for row in rows:
                row[field.name] = msgspec.json.encode(row.get(field.name)).decode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
    tmp.replace(path)  # a reader never sees a half-written log
    return path


def _read_parquet(path: Path) -> list:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    name = meta.get(_TYPE_KEY, b"").decode()
    if name not in _LOG_TYPES:
        raise ValueError(
            f"{path} is not a parley log (schema metadata parley.type={name!r}); write it with evaluation.evallog.write_parquet"
        )
    cls = _LOG_TYPES[name]
    columns = {column: (f, dtype) for f, column, dtype in _columns(cls)}
    json_cols = {f.name for f in table.schema if f.metadata and f.metadata.get(_JSON_KEY) == b"json"}
    out = []
    for row in table.to_pylist():
        # Columns this code does not know (a newer writer) are dropped; missing ones take defaults.
        fields = {}
        for k, v in row.items():
            if k not in columns:
                continue
            f, dtype = columns[k]
            if k in json_cols:
                fields[f.encode_name] = json.loads(v)
            elif dtype is None or v:
                fields[f.encode_name] = _field_value(v, f.type, dtype)
        out.append(msgspec.convert(fields, cls))
    return out


def _read_jsonl(path: Path) -> list:
    out = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            raw = msgspec.json.decode(line)
            cls = EvalRecord if "eval_id" in raw else Scored if "traj_id" in raw else None
            if cls is None:
                raise ValueError(f"{path}:{lineno}: neither an EvalRecord (eval_id) nor a Scored trajectory (traj_id)")
            try:
                out.append(msgspec.convert(raw, cls))
            except msgspec.ValidationError as e:
                raise ValueError(f"{path}:{lineno}: bad {cls.__name__}: {e}") from None
    return out


def write_jsonl(records: Iterable[msgspec.Struct], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for r in records:
            f.write(msgspec.json.encode(r) + b"\n")
    return path


def read_log(path: str | Path) -> list:
    """EvalRecords and/or Scored trajectories from a .parquet or .jsonl file, as stored, or from every
    such file in a directory (in name order: the learner's archive names them by step)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"log {p} does not exist")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in (".parquet", ".jsonl"))
        if not files:
            raise ValueError(f"log directory {p} holds no .parquet or .jsonl logs")
        return [r for f in files for r in read_log(f)]
    if p.suffix == ".parquet":
        return _read_parquet(p)
    if p.suffix in (".jsonl", ".json"):
        return _read_jsonl(p)
    raise ValueError(f"log {p} has suffix {p.suffix!r}; use .parquet or .jsonl")


def read_records(path: str | Path) -> list[EvalRecord]:
    """The log as EvalRecords; training trajectories (Scored) are converted with from_scored."""
    return as_records(read_log(path))


def as_records(items) -> list[EvalRecord]:
    """EvalRecords as they are, Scored converted with from_scored; a Scored whose conversation its
    actor abandoned (protocol.messages.ABANDONED_STALE: cut short, never judged, never trained) is
    left out, so a replay neither judges half a conversation nor counts its empty reward."""
    return [
        r if isinstance(r, EvalRecord) else from_scored(r)
        for r in items
        if isinstance(r, EvalRecord) or r.trajectory.terminated != ABANDONED_STALE
    ]


def from_scored(s: Scored) -> EvalRecord:
    """A scored training trajectory as an EvalRecord; its condition is the policy version "v<N>"
    (the newest version that produced one of its turns), so versions can be compared over items."""
    traj = s.trajectory
    version = max((t.version for t in traj.turns), default=-1)
    system = traj.messages[0].content if traj.messages and traj.messages[0].role == "system" else ""
    return EvalRecord(
        eval_id=s.traj_id,
        condition=f"v{version}",
        item_id=traj.item_id,
        model=traj.model,
        system_prompt=system,
        sim_prompt=traj.sim_prompt,
        sim_model="",
        judge_model=s.judge_model,
        seed=traj.seed,
        messages=list(traj.messages),
        reference=traj.reference,
        assistant_tokens=traj.assistant_tokens,
        metrics=dict(s.metrics),
        document=s.document,
        judge=list(s.judge),
        version=version,
        created=s.created,
    )


async def read_stream(js, run: str, key: str) -> list:
    """Every message stored on a run's channel ("eval" or "scored"), decoded, in stream order."""
    from nats.js.errors import NotFoundError

    from parley.protocol import codec, topology

    if key not in ("eval", "scored"):
        raise ValueError(f"replay reads the 'eval' or 'scored' stream, not {key!r}")
    name = topology.stream_name(run, key)
    info = await js.stream_info(name)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(name, seq)
        except NotFoundError:  # deleted or aged out in the middle of the range
            continue
        out.append(codec.decode(key, msg.data))
    return out


def stored_interactivity_scale(rec: EvalRecord) -> str:
    """Which scale a record's stored interactivity is on, read from the judge ops it records; a record
    without any judge output predates the 3-level op, so its scale is the rubric."""
    ops = {o.op for o in rec.judge}
    return next((name for name, op in INTERACTIVITY_SCALES.items() if op in ops), "rubric")


def reweight(
    records: Iterable[EvalRecord],
    weights: dict[str, float],
    *,
    clamps: dict[str, tuple[float, float]] | None = None,
    bleu_variant: str = "sacrebleu",
    interactivity: str | None = None,
    env: Environment | None = None,
) -> list[EvalRecord]:
    """Re-score without any model, metric by metric of the environment's reward (`env`; by default the
    default environment scored with `bleu_variant`): a pure metric is recomputed from the stored conversation; a judge
    metric of the "extract" operation is recomputed from the stored extracted document (CollabLLM's BLEU,
    with `bleu_variant`); any other judge metric is reused as stored (CollabLLM's interactivity: with
    `interactivity` named, it must be on that scale, another scale needs the judge). "reward" = the
    weighted total."""
    if env is None:
        from parley.config.env import default_with

        if bleu_variant not in BLEU_VARIANTS:
            raise ValueError(f"bleu_variant={bleu_variant!r} not allowed; use one of {sorted(BLEU_VARIANTS)}")
        env = default_with(bleu_variant=bleu_variant)
    if interactivity is not None and interactivity not in INTERACTIVITY_SCALES:
        raise ValueError(f"interactivity={interactivity!r} not allowed; use one of {sorted(INTERACTIVITY_SCALES)}")
    out = []
    for rec in records:
        metrics = {}
        for m in env.reward.metrics:
            if isinstance(m, PureMetric):
                metrics[m.name] = float(m.compute(rec))
            elif m.op == EXTRACT_OP:  # the record keeps the extract reply's document
                metrics[m.name] = float(m.value(JudgeReply(ok=True, document=rec.document), rec))
            else:
                metrics[m.name] = _stored(rec, m.name, interactivity)
        metrics["reward"] = total_reward(metrics, weights, clamps)
        out.append(msgspec.structs.replace(rec, metrics=metrics))
    return out


EXTRACT_OP = "extract"  # the judge operation whose reply (the document) an EvalRecord stores


def _stored(rec: EvalRecord, name: str, interactivity: str | None) -> float:
    """A judge metric's stored value, to be reused; interactivity's scale checked when one is asked for."""
    if name not in rec.metrics:
        raise ValueError(
            f"record {rec.eval_id!r} has no stored {name}; re-weighting reuses it, so this log needs a judge (--judge)"
        )
    if name == "interactivity":
        scale = stored_interactivity_scale(rec)
        if interactivity is not None and scale != interactivity:
            raise ValueError(
                f"record {rec.eval_id!r} holds interactivity on the {scale!r} scale, not {interactivity!r}; "
                "re-rate it with the judge (--judge, a judge service on --nats)"
            )
    return float(rec.metrics[name])


async def rejudge(records: Sequence[EvalRecord], judge, cfg) -> list[EvalRecord]:
    """Re-score with another judge (a services.judge.client.Judge, e.g. JudgeClient over NATS) and the weights,
    clamps and BLEU variant of `cfg` (a ScorerConfig); nothing is generated. "reward" = the weighted total."""
    import asyncio

    from parley.protocol.messages import Trajectory
    from parley.rollout.score import score_trajectory

    async def one(rec: EvalRecord) -> EvalRecord:
        # Only the conversation, reference, seed and token count matter to the judge and the metrics.
        traj = Trajectory(
            traj_id=rec.eval_id,
            task_id=rec.eval_id,
            sample=0,
            run="replay",
            item_id=rec.item_id,
            messages=list(rec.messages),
            turns=[],
            reference=rec.reference,
            assistant_tokens=rec.assistant_tokens,
            seed=rec.seed,
            sim_prompt=rec.sim_prompt,
            model=rec.model,
        )
        # Failures propagate as services.judge.client's / rollout.score's errors, which name the record (traj_id = eval_id).
        scored = await score_trajectory(traj, judge, cfg, scorer="replay")
        return msgspec.structs.replace(
            rec,
            metrics={**scored.metrics, "reward": scored.total},
            document=scored.document,
            judge=list(scored.judge),
            judge_model=scored.judge_model,
        )

    return list(await asyncio.gather(*(one(r) for r in records)))
