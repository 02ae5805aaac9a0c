"""Attention over packed micro-batches: sequences concatenated in one row, told apart by restarting
position_ids. On CUDA the learner's default is flash varlen attention (torch.nn.attention.varlen,
per-sequence boundaries, no (T, T) mask, no work across sequences); on CPU transformers' SDPA with the
block-diagonal mask it builds from the positions. Installed by learner.trainer on the policy and the
reference; bench/learner_gpu.py times both. `check_packing_isolated` is the start-up guard that the
installed transformers really keeps packed sequences apart on the SDPA path."""

from __future__ import annotations

import copy
import inspect
import logging
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from parley.config.learner import ATTENTIONS

log = logging.getLogger(__name__)

VARLEN = "parley_varlen"  # the name our packed attention is registered under in transformers

# The kernel behind VARLEN: flash varlen on CUDA when it passes check_varlen, else one SDPA call per
# sequence (CPU, or a torch without a usable varlen_attn). Chosen once per process.
_kernel: dict = {"name": None, "fn": None, "why": ""}
_captured: dict = {"position_ids": None}  # the decoder stack's last position_ids (capture_positions)
_bounds_slot: tuple | None = None  # (weakref to position_ids, bounds) of the last forward


def sequence_bounds(position_ids: Tensor) -> tuple[Tensor, list[int], int]:
    """(cu_seqlens (S+1,) int32, the same as a list, longest sequence) of a packed (1, T) position_ids.
    Every layer of a forward gets the same position_ids object: computed (and synced) once per forward."""
    global _bounds_slot
    if _bounds_slot is not None and _bounds_slot[0]() is position_ids:
        return _bounds_slot[1]
    pos = position_ids[0]  # (T,)
    bounds = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
    if bounds[0] != 0:
        raise ValueError("packed position_ids must start a sequence at index 0")
    cu = torch.tensor(bounds, dtype=torch.int32, device=pos.device)  # (S+1,)
    info = (cu, bounds, max(b - a for a, b in zip(bounds, bounds[1:])))
    _bounds_slot = (weakref.ref(position_ids), info)
    return info


def seqloop(q: Tensor, k: Tensor, v: Tensor, bounds: list[int], scale: float) -> Tensor:
    """Causal SDPA of each packed sequence on its own: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D).
    The reference the varlen kernel is checked against, and its fallback."""
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, T, D)
    outs = [
        F.scaled_dot_product_attention(
            qh[None, :, a:b], kh[None, :, a:b], vh[None, :, a:b], is_causal=True, scale=scale, enable_gqa=True
        )[0]
        for a, b in zip(bounds, bounds[1:])
    ]  # each (Hq, s, D)
    return torch.cat(outs, dim=1).transpose(0, 1)


def flash_varlen(expand_kv: bool):
    """torch.nn.attention.varlen.varlen_attn (flash, CUDA only) behind one signature; its keyword
    arguments changed between torch releases (is_causal in 2.10, window_size and enable_gqa later).
    expand_kv repeats the kv heads for GQA, for a release whose varlen_attn refuses fewer kv heads."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters

    def kernel(q, k, v, cu, max_len, scale):
        kw = {}
        if k.shape[1] != q.shape[1]:
            if expand_kv:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            elif "enable_gqa" in params:
                kw["enable_gqa"] = True
        if "window_size" in params:
            kw["window_size"] = (-1, 0)  # causal
        elif "is_causal" in params:
            kw["is_causal"] = True
        else:
            raise RuntimeError(f"varlen_attn{inspect.signature(varlen_attn)} has neither window_size nor is_causal")
        if "scale" in params:
            kw["scale"] = scale
        elif abs(scale - q.shape[-1] ** -0.5) > 1e-9:
            raise RuntimeError("this varlen_attn takes no scale and the model's is not 1/sqrt(head_dim)")
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)

    return kernel


def check_varlen(kernel, device, dtype=torch.bfloat16) -> float:
    """Largest difference of the output and of the input gradients between `kernel` and seqloop on a
    small packed GQA input, relative to each tensor's largest value."""
    gen = torch.Generator(device=device).manual_seed(0)
    bounds = [0, 100, 357, 421]
    shapes = [(421, 4, 128), (421, 2, 128), (421, 2, 128)]
    base = [torch.randn(s, device=device, dtype=dtype, generator=gen) for s in shapes]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    grad = torch.randn(421, 4, 128, device=device, dtype=dtype, generator=gen)
    outs = []
    runs = (lambda q, k, v: kernel(q, k, v, cu, 257, 128**-0.5), lambda q, k, v: seqloop(q, k, v, bounds, 128**-0.5))
    for run in runs:
        qkv = [t.clone().requires_grad_(True) for t in base]
        out = run(*qkv)
        out.backward(grad)
        outs.append([out.detach()] + [t.grad for t in qkv])
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(*outs))


# bf16 rounding of a different summation order gives about 1% here; a wrong mask or layout gives order 1.
VARLEN_TOLERANCE = 0.05


def _choose_kernel(device: torch.device) -> None:
    """Flash varlen if it is there and agrees with seqloop (native GQA first, then expanded kv heads)."""
    if _kernel["name"] is not None:
        return
    if device.type != "cuda":
        _kernel.update(name="seqloop", fn=None, why="varlen_attn needs CUDA")
        return
    notes = []
    for expand_kv in (False, True):
        label = "expanded kv heads" if expand_kv else "native GQA"
        try:
            fn = flash_varlen(expand_kv)
            err = check_varlen(fn, device)
        except Exception as e:  # an older torch without the module, or a kernel that refuses the shapes
            notes.append(f"{label}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if err > VARLEN_TOLERANCE:
            notes.append(f"{label}: differs from per-sequence SDPA by {err:.3g}")
            continue
        _kernel.update(name="varlen", fn=fn, why="; ".join(notes + [f"{label}, max relative diff {err:.2g}"]))
        return
    _kernel.update(name="seqloop", fn=None, why="varlen_attn unusable: " + "; ".join(notes))


@torch.compiler.disable
def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (registered as VARLEN): query (1, Hq, T, D), key/value
    (1, Hkv, T, D) -> ((1, T, Hq, D), None). The sequences come from the position_ids (the layers pass
    them in kwargs; else the ones the decoder stack was called with). transformers builds no mask for
    an attention name it does not know, so no (T, T) tensor exists on this path."""
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    if dropout:
        raise ValueError(f"packed attention has no dropout (got {dropout}); the learner trains without it")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = _captured["position_ids"]
    if position_ids is None or position_ids.shape[-1] != query.shape[2]:
        raise RuntimeError("packed attention found no position_ids for this forward")
    cu, bounds, max_len = sequence_bounds(position_ids)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (T, H, D)
    if _kernel["name"] == "varlen":
        out = _kernel["fn"](q, k, v, cu, max_len, scale)
    else:
        out = seqloop(q, k, v, bounds, scale)
    return out[None], None


def capture_positions(model) -> None:
    """Keep the position_ids each forward of the decoder stack is called with, for a transformers
    release whose layers do not pass them on to the attention function."""
    base = model.base_model
    if getattr(base, "_parley_captures", False):
        return

    def hook(module, args, kwargs):
        _captured["position_ids"] = kwargs.get("position_ids")

    base.register_forward_pre_hook(hook, with_kwargs=True)
    base._parley_captures = True


def use(model, name: str) -> None:
    """Switch a loaded transformers model to "sdpa" or VARLEN."""
    if name == VARLEN:
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN, packed_attention)
        capture_positions(model)
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError):  # an older transformers: set it on the config, which every layer reads
        model.config._attn_implementation = name
    if model.config._attn_implementation != name:
        raise RuntimeError(f"could not switch attention to {name!r} (still {model.config._attn_implementation!r})")


def resolve(requested: str, device: torch.device) -> tuple[str, str]:
    """(attention name for transformers, what runs behind it) for [learner] attention on `device`:
    auto = flash varlen on CUDA when usable (else SDPA, with the reason), SDPA on CPU; "varlen" is
    VARLEN whatever its kernel (on CPU one SDPA call per sequence: how the tests run this path)."""
    if requested not in ATTENTIONS:
        raise ValueError(f"attention={requested!r} not allowed; use one of {ATTENTIONS}")
    if requested == "sdpa" or (requested == "auto" and device.type != "cuda"):
        return "sdpa", "sdpa (block-diagonal mask from position_ids)"
    _choose_kernel(device)
    if requested == "auto" and _kernel["name"] != "varlen":
        log.warning("flash varlen attention unavailable (%s); packed sequences use SDPA with a mask", _kernel["why"])
        return "sdpa", f"sdpa (block-diagonal mask); {_kernel['why']}"
    return VARLEN, f"{VARLEN} ({_kernel['name']}: {_kernel['why']})"


# -- the start-up guard ---------------------------------------------------------------------------

# A model of the loaded architecture this small builds in milliseconds on the CPU.
_SMALL = dict(
    num_hidden_layers=1,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=64,
)


def packing_leak(config, attention: str = "sdpa") -> float:
    """How much packing changes a sequence: the largest difference between the logits of a sequence
    packed after another and the same sequence alone, for a small random model of `config`'s
    architecture in fp32 on the CPU. 0 (to rounding) when the installed transformers turns restarting
    position_ids into a block-diagonal mask; order 1 when packed sequences attend to each other."""
    from transformers import AutoModelForCausalLM

    small = copy.deepcopy(config)
    for key, value in _SMALL.items():
        if hasattr(small, key):
            setattr(small, key, value)
    if getattr(small, "layer_types", None):
        small.layer_types = small.layer_types[:1]
    small.tie_word_embeddings = False
    # A pad id of the full vocabulary (random_qwen3's is 151643) is no row of the small embedding.
    small.pad_token_id = None
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(small, dtype=torch.float32, attn_implementation="sdpa").eval()
    use(model, attention)
    first = torch.randint(0, 64, (1, 7), generator=gen)
    second = torch.randint(0, 64, (1, 5), generator=gen)
    packed_ids = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[0, 7:]
        alone = model(input_ids=second, position_ids=torch.arange(5)[None], use_cache=False).logits[0]
    return float((packed - alone).abs().max())


def check_packing_isolated(config) -> None:
    """Refuse to train on packed micro-batches if the installed transformers lets their sequences
    attend to each other on the SDPA path (it then treats the pack as one causal sequence)."""
    import transformers

    leak = packing_leak(config, "sdpa")
    if leak > 1e-4:
        raise RuntimeError(
            f"transformers {transformers.__version__} lets packed sequences attend to each other (a sequence's "
            f"logits change by {leak:.3g} when packed after another): install the range pyproject.toml pins, or "
            'set [learner] attention = "varlen"'
        )
