"""The KV sweep: every causal-LM config class transformers declares, its cache filled by transformers, against our
figures."""

import warnings
from dataclasses import dataclass

import torch
import transformers

from mstar_utils.upstream import cache_arg, output_cache
from mstar_utils.kv import kv_geometry

# Released defaults that transformers' own model cannot run as they stand, and the smallest change that lets it:
# each keeps the class's shapes and only picks which layers attend.
FIXUPS = {
    'bamba': dict(
        attn_layer_indices=[9, 18, 27]
    ),  # default: no attention layer, and the model then fails get_seq_length
    'granitemoehybrid': dict(layer_types=['mamba'] * 3 + ['attention'] + ['mamba'] * 28),
    'lfm2': dict(
        full_attn_idxs=[2, 5, 8, 10, 12, 14]
    ),  # default: every layer attends, no conv layer (LFM2-1.2B's layout)
}


@dataclass(frozen=True)
class SweepResult:
    "One config class against transformers' cache: what it held at two lengths, what we say, or why it was skipped."

    model_type: str
    status: str  # matched, mismatched or skipped
    reason: str = ''
    grows: int | None = None  # bytes per token transformers' cache grew by
    stays: int | None = None  # bytes it held besides
    per_token: int | None = None  # ours, convention='transformers'
    fixed: int | None = None


def cache_bytes(obj, seen=None, depth=0) -> int:
    """Bytes of every tensor a transformers cache holds: its layers' keys, values, states, indexer keys, MiniMax's
    linear_cache."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):  # integer tensors are bookkeeping (window sizes, lengths), not cached values
        if id(obj) in seen or not obj.is_floating_point():
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if depth > 4 or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif hasattr(obj, '__dict__') and type(obj).__module__.startswith('transformers'):
        items = vars(obj).values()
    else:
        return 0
    return sum(cache_bytes(v, seen, depth + 1) for v in items)


def _windows(text) -> int:
    "The longest window or chunk a config's layers keep, 0 without one."
    return max([getattr(text, k, None) or 0 for k in ('sliding_window', 'attention_chunk_size')] + [0])


def _module_states(model) -> list:
    "Tensors `model`'s modules keep as plain attributes (not parameters or buffers)."
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]


def _filled(model, config, tokens: int, device: str = 'meta'):
    """transformers' cache after one forward of `tokens` tokens through `model` (on meta: shapes and dtypes, no
    arithmetic)."""
    ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = output_cache(out)
    if cache is not None:
        return cache
    # RecurrentGemma returns no cache: its forward builds one for the attention layers and keeps the RG-LRU states on
    # its modules. Hand it the cache, and count what its modules hold after the forward that they did not before.
    from transformers import DynamicCache

    held = _module_states(model)  # kept alive, so no new tensor takes one of their ids
    before = {id(t) for t in held}
    cache = DynamicCache(config=config)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_arg(model): cache})
    except TypeError:
        raise LookupError('its forward returns no cache and takes none') from None
    states = [t for t in _module_states(model) if id(t) not in before]
    if not states and not cache_bytes(cache):
        raise LookupError('its forward returns no cache')
    return cache, states


def _config(model_type: str, dtype, tokens: int | None = None, decoder: bool = False, overrides=None):
    """`model_type`'s config class with its defaults (and FIXUPS, then `overrides`), in `dtype`, long enough for
    `tokens`, as a decoder if asked."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**{**FIXUPS.get(model_type, {}), **(overrides or {})})
    config.dtype = dtype
    text = config.get_text_config(decoder=True)
    if decoder:
        config.is_decoder = text.is_decoder = True  # BERT-like classes cache only as decoders
    if tokens and (getattr(text, 'max_position_embeddings', None) or tokens) < tokens:
        text.max_position_embeddings = tokens  # a window longer than the context: run (and count) past it
    return config


def sweep_one(
    model_type: str, dtype=torch.bfloat16, overrides: dict | None = None, device: str = 'meta'
) -> SweepResult:
    """Build `model_type`'s causal LM from its config class's defaults (or `overrides` of them) on meta, fill its cache
    at two lengths, compare. A tiny config whose forward meta cannot run (`nonzero`) runs on `device='cpu'`. A class
    with no causal LM (GLM-5-Next) is built as its base model, whose forward returns the same cache."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    auto = AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel

    try:
        text = _config(model_type, dtype, overrides=overrides).get_text_config(decoder=True)
    except Exception as e:
        return SweepResult(model_type, 'skipped', f'config class: {type(e).__name__}: {str(e)[:120]}')
    t1 = max(_windows(text) + 1, 3)
    t2 = t1 + 4
    for decoder in (False, True):
        try:
            config = _config(model_type, dtype, t2, decoder, overrides=overrides)
        except Exception as e:
            return SweepResult(model_type, 'skipped', f'config class: {type(e).__name__}: {str(e)[:120]}')
        try:
            g = kv_geometry(config, convention='transformers')
        except ValueError as e:
            return SweepResult(model_type, 'skipped', f'not counted: {str(e)[:160]}')
        try:
            with warnings.catch_warnings(), torch.device(device):
                warnings.simplefilter('ignore')
                model = auto.from_config(config, dtype=dtype).eval()
        except Exception as e:
            return SweepResult(model_type, 'skipped', f'model build: {type(e).__name__}: {str(e)[:120]}')
        try:
            b1, b2 = (cache_bytes(_filled(model, config, t, device)) for t in (t1, t2))
        except LookupError as e:
            if not decoder and hasattr(config, 'is_decoder'):
                continue
            return SweepResult(model_type, 'skipped', f'forward on {device}: {e}')
        except Exception as e:
            return SweepResult(model_type, 'skipped', f'forward on {device}: {type(e).__name__}: {str(e)[:120]}')
        break
    if b1 == 0 and b2 == 0:
        return SweepResult(model_type, 'skipped', 'its cache holds no tensors')
    grows, rem = divmod(b2 - b1, t2 - t1)
    stays = b1 - t1 * grows
    cross = sum(layer.fixed_bytes for layer in g.layers if layer.kind == 'cross_attention')
    note = 'cross-attention left out: a causal-LM forward encodes no image or audio' if cross else ''
    ok = rem == 0 and grows == g.bytes_per_token and stays == g.fixed_bytes - cross
    return SweepResult(
        model_type,
        'matched' if ok else 'mismatched',
        note,
        grows,
        stays=stays,
        per_token=g.bytes_per_token,
        fixed=g.fixed_bytes - cross,
    )


def causal_lm_types() -> list[str]:
    "Every model type transformers maps to a causal LM class."
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


if __name__ == '__main__':
    import collections
    import sys
    import time

    transformers.utils.logging.set_verbosity_error()
    t0 = time.time()
    res = [sweep_one(mt) for mt in (sys.argv[1:] or causal_lm_types())]
    for r in res:
        if r.status != 'matched':
            print(r)
    print(collections.Counter(r.status for r in res), f'{time.time() - t0:.0f} s')
