"""The fault matrix: real checkpoints (SmolLM2, all-MiniLM-L6-v2) and real tokenizers, damaged on purpose.

Every case names the exact exception type and a message fragment that names the culprit (file, key, prefix, token id),
and every failed load is checked to leave the module as it was, for a module built on meta and for a materialized one.
Damaged files are small: a few real tensors copied out of the cached checkpoints with safetensors, then broken.
"""

import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import json
import logging
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
from mstar_utils.model import meta_module
import mstar_utils.io as mio
from mstar_utils.testing import assert_state_dict_equal
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from mstar_utils.checkpoints import minilm_checkpoint, smollm2_checkpoint, tokenizer_folder
from mstar_utils.detokenize import ByteLevelDetokenizer, SentencePieceDetokenizer
from mstar_utils.generation import load_generation_defaults
from mstar_utils.loading import ModuleAndPrefix, load_weights, load_weights_from_file, load_weights_from_hf_shards
from mstar_utils.sources import INDEX_FILE, SINGLE_FILE, JSONFileError, read_weight_map

SMOL, MINI = smollm2_checkpoint(), minilm_checkpoint()
SMOL_CFG, MINI_CFG = AutoConfig.from_pretrained(SMOL), AutoConfig.from_pretrained(MINI)
SHARD1, SHARD2 = 'model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'


# ---------------------------------------------------------------- small real checkpoints


def _real(folder: Path, keys) -> dict:
    "The tensors `keys` of the checkpoint in `folder`, read with safetensors itself (the reference reader)."
    wm, out = read_weight_map(folder), {}
    for k in keys:
        with safe_open(str(wm[k]), framework='pt') as f:
            out[k] = f.get_tensor(k)
    return out


@pytest.fixture(scope='session')
def smol_src(tmp_path_factory) -> Path:
    "SmolLM2's decoder layers 0 and 1 and final norm, real bf16 tensors, in two shards behind an index."
    keys = [
        k
        for k in read_weight_map(SMOL)
        if k.startswith(('model.layers.0.', 'model.layers.1.')) or k == 'model.norm.weight'
    ]
    sd = _real(SMOL, keys)
    d = tmp_path_factory.mktemp('smol')
    shards = {SHARD1: {k: v for k, v in sd.items() if k.startswith('model.layers.0.')}}
    shards[SHARD2] = {k: v for k, v in sd.items() if k not in shards[SHARD1]}
    for name, part in shards.items():
        save_file(part, str(d / name), metadata={'format': 'pt'})
    index = {
        'metadata': {'total_size': sum(v.nbytes for v in sd.values())},
        'weight_map': {k: name for name, part in shards.items() for k in part},
    }
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return d


@pytest.fixture(scope='session')
def mini_src(tmp_path_factory) -> Path:
    "all-MiniLM-L6-v2's first encoder layer, real fp32 tensors, as a lone model.safetensors."
    sd = _real(MINI, [k for k in read_weight_map(MINI) if k.startswith('encoder.layer.0.')])
    d = tmp_path_factory.mktemp('mini')
    save_file(sd, str(d / SINGLE_FILE), metadata={'format': 'pt'})
    return d


def _copy(src: Path, dst: Path) -> Path:
    "A private copy of the checkpoint folder `src`: hard links, which `_rewrite` breaks before changing a file."
    dst.mkdir()
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy(f, dst / f.name)
    return dst


def _rewrite(p: Path, data: bytes):
    p.unlink()
    p.write_bytes(data)  # never write through a hard link to the shared source


class SmolMini(nn.Module):
    "Decoder layers 0-1 and the final norm of SmolLM2, the names they carry under the prefix 'model.'."

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(LlamaDecoderLayer(SMOL_CFG, i) for i in range(2))
        self.norm = LlamaRMSNorm(SMOL_CFG.hidden_size, eps=SMOL_CFG.rms_norm_eps)


def _build(make, kind: str, dtype) -> nn.Module:
    if kind == 'meta':
        return meta_module(make, dtype)
    torch.manual_seed(0)
    m = make().to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()  # values no checkpoint holds
    return m


CKPTS = {  # name: (source fixture, module factory, dtype, prefix)
    'smol': ('smol_src', SmolMini, torch.bfloat16, 'model.'),
    'mini': ('mini_src', lambda: BertLayer(MINI_CFG), torch.float32, 'encoder.layer.0.'),
}


def _snapshot(m: nn.Module) -> dict:
    return {n: (t, None if t.is_meta else t.detach().clone()) for n, t in m.state_dict(keep_vars=True).items()}


def assert_unchanged(m: nn.Module, snap: dict):
    "Every parameter and buffer is the same object as before, with the same values (or still on meta)."
    now = m.state_dict(keep_vars=True)
    assert now.keys() == snap.keys()
    for n, (t, before) in snap.items():
        assert now[n] is t, f'{n} was replaced'
        if before is None:
            assert now[n].is_meta, f'{n} left meta'
        else:
            assert torch.equal(now[n], before), f'{n} was overwritten'


def _msg(e: BaseException) -> str:
    return e.args[0] if isinstance(e, KeyError) and e.args else str(e)


# ---------------------------------------------------------------- damage


def _header(data: bytes) -> tuple[int, dict]:
    n = int.from_bytes(data[:8], 'little')
    return n, json.loads(data[8 : 8 + n])


def _with_header(header: dict, body: bytes) -> bytes:
    hb = json.dumps(header).encode()
    hb += b' ' * (-len(hb) % 8)
    return len(hb).to_bytes(8, 'little') + hb + body


def _last_tensor(data: bytes) -> str:
    n, h = _header(data)
    return max((k for k in h if k != '__metadata__'), key=lambda k: h[k]['data_offsets'][1])


def _f6_tensor(data: bytes) -> str:
    "A 1-d tensor whose byte size is a multiple of 3, so the same bytes are a whole number of 6-bit floats."
    n, h = _header(data)
    return next(
        k
        for k, v in h.items()
        if k != '__metadata__' and len(v['shape']) == 1 and (v['data_offsets'][1] - v['data_offsets'][0]) % 3 == 0
    )


def _to_f6(data: bytes) -> bytes:
    n, h = _header(data)
    k = _f6_tensor(data)
    b, e = h[k]['data_offsets']
    h[k] = dict(h[k], dtype='F6_E2M3', shape=[(e - b) * 8 // 6])
    return _with_header(h, data[8 + n :])


def _bad_json(data: bytes) -> bytes:
    assert data[8:9] == b'{'
    return data[:8] + b'x' + data[9:]  # same length, so the header length still fits


# name: (damage(bytes) -> bytes, exception, message fragment given the damaged file's name and original bytes)
FILE_FAULTS = {
    'header_cut': (
        lambda d: d[: 8 + int.from_bytes(d[:8], 'little') // 2],
        ValueError,
        lambda f, d: (
            rf"{f}: header length is {int.from_bytes(d[:8], 'little')} bytes, but only \d+ bytes follow it: "
            r"header cut short"
        ),
    ),
    'data_cut': (
        lambda d: d[:-100],
        ValueError,
        lambda f, d: rf"{f}: data cut short: .*tensor '{re.escape(_last_tensor(d))}' and any after it are incomplete",
    ),
    'header_len_past_end': (
        lambda d: (2 * len(d)).to_bytes(8, 'little') + d[8:],
        ValueError,
        lambda f, d: rf"{f}: header length is {2 * len(d)} bytes, but only {len(d) - 8} bytes follow it",
    ),
    'header_not_json': (_bad_json, ValueError, lambda f, d: rf'{f}: header is not valid JSON'),
    'dtype_torch_lacks': (
        _to_f6,
        ValueError,
        lambda f, d: rf"{f}: tensor '{re.escape(_f6_tensor(d))}' has dtype F6_E2M3, which has no torch dtype",
    ),
    'empty': (lambda d: b'', ValueError, lambda f, d: rf'{f}: 0 bytes, too short for a safetensors file'),
}


@pytest.mark.parametrize('kind', ['meta', 'materialized'])
@pytest.mark.parametrize(
    'ckpt,victim,loader', [('smol', SHARD2, 'shards'), ('mini', SINGLE_FILE, 'shards'), ('mini', SINGLE_FILE, 'file')]
)
@pytest.mark.parametrize('fault', list(FILE_FAULTS))
def test_damaged_safetensors(fault, ckpt, victim, loader, kind, tmp_path, request):
    src, make, dtype, prefix = CKPTS[ckpt]
    d = _copy(request.getfixturevalue(src), tmp_path / 'ckpt')
    damage, exc, frag = FILE_FAULTS[fault]
    orig = (d / victim).read_bytes()
    _rewrite(d / victim, damage(orig))
    m = _build(make, kind, dtype)
    snap = _snapshot(m)
    call = (
        (lambda: load_weights_from_hf_shards(d, [ModuleAndPrefix(m, prefix)]))
        if loader == 'shards'
        else (lambda: load_weights_from_file(d / victim, [ModuleAndPrefix(m, prefix)]))
    )
    with pytest.raises(exc) as ei:
        call()
    assert ei.type is exc
    assert re.search(frag(re.escape(victim), orig), _msg(ei.value)), _msg(ei.value)
    assert_unchanged(m, snap)


# ---------------------------------------------------------------- the index, tensors and modules


def _index(d: Path) -> dict:
    return json.loads((d / INDEX_FILE).read_text())


def _set_index(d: Path, text: str):
    _rewrite(d / INDEX_FILE, text.encode())


def _dup_key(d):
    "'model.norm.weight' listed twice, first in shard 1, then in shard 2: json.loads would keep the second silently."
    wm = _index(d)['weight_map']
    del wm['model.norm.weight']
    body = ',\n'.join(f'    {json.dumps(k)}: {json.dumps(v)}' for k, v in wm.items())
    _set_index(
        d,
        '{"weight_map": {\n'
        + body
        + f',\n    "model.norm.weight": "{SHARD1}",\n    "model.norm.weight": "{SHARD2}"\n}}}}',
    )


def _outside(shard_for):
    def damage(d):
        ix = _index(d)
        ix['weight_map']['model.norm.weight'] = shard_for(d)
        _set_index(d, json.dumps(ix))
        shutil.copy(d / SHARD2, d.parent / SHARD2)  # a real shard sits there: existing is not enough

    return damage


def _reshape_up_proj(d):
    "Shard 2 with layer 1's up_proj stored transposed: same bytes, another shape."
    sd = load_file(str(d / SHARD2))
    k = 'model.layers.1.mlp.up_proj.weight'
    sd[k] = sd[k].t().contiguous()
    (d / SHARD2).unlink()
    save_file(sd, str(d / SHARD2))


def _assign_to_wrong_shard(d):
    ix = _index(d)
    ix['weight_map']['model.norm.weight'] = SHARD1
    _set_index(d, json.dumps(ix))


def _double_prefix(d):
    "Every key renamed model.X -> model.model.X, in the shards and the index."
    for name in (SHARD1, SHARD2):
        sd = {'model.' + k: t for k, t in load_file(str(d / name)).items()}
        (d / name).unlink()
        save_file(sd, str(d / name))
    ix = _index(d)
    ix['weight_map'] = {'model.' + k: v for k, v in ix['weight_map'].items()}
    _set_index(d, json.dumps(ix))


@dataclass
class Fault:
    damage: Callable[[Path], None]
    exc: type
    match: str
    prefix: str = 'model.'


INDEX = re.escape(INDEX_FILE)
FOLDER_FAULTS = {
    'index_not_json': Fault(
        lambda d: _set_index(d, (d / INDEX_FILE).read_text()[:-20]), JSONFileError, rf'{INDEX}: not valid JSON'
    ),
    'index_without_weight_map': Fault(
        lambda d: _set_index(d, json.dumps({'metadata': _index(d)['metadata']})),
        ValueError,
        rf'{INDEX}: no "weight_map" object',
    ),
    'weight_map_not_object': Fault(
        lambda d: _set_index(d, json.dumps({'weight_map': [SHARD1]})), ValueError, rf'{INDEX}: no "weight_map" object'
    ),
    'shard_name_not_str': Fault(
        lambda d: _set_index(d, json.dumps({'weight_map': {'model.norm.weight': ['x']}})),
        ValueError,
        r"weight_map\['model.norm.weight'\] is \['x'\], not a shard file name",
    ),
    'shard_outside_relative': Fault(
        _outside(lambda d: f'../{SHARD2}'),
        ValueError,
        rf"shard '\.\./{re.escape(SHARD2)}' for key 'model\.norm\.weight' is outside the checkpoint folder",
    ),
    'shard_outside_absolute': Fault(
        _outside(lambda d: str(d.parent / SHARD2)),
        ValueError,
        rf"shard '/.*{re.escape(SHARD2)}' for key 'model\.norm\.weight' is outside the checkpoint folder",
    ),
    'shard_missing': Fault(
        lambda d: (d / SHARD2).unlink(),
        FileNotFoundError,
        rf"shard {re.escape(SHARD2)} is missing from .*\(it should hold 'model\.layers\.1\.",
    ),
    'key_in_two_shards': Fault(
        _dup_key,
        ValueError,
        rf"key 'model\.norm\.weight' is listed twice in weight_map, in shard '{re.escape(SHARD1)}' and in shard "
        rf"'{re.escape(SHARD2)}'",
    ),
    'key_not_in_its_shard': Fault(
        _assign_to_wrong_shard, KeyError, rf"{re.escape(SHARD1)}: has no tensor 'model\.norm\.weight'"
    ),
    'shape_differs': Fault(
        _reshape_up_proj,
        ValueError,
        r"shape mismatch for 'model\.layers\.1\.mlp\.up_proj\.weight' in .*: checkpoint has \[576, 1536\], "
        r"module SmolMini expects \[1536, 576\]",
    ),
    'prefix_too_long': Fault(
        lambda d: None,
        KeyError,
        r"no key starts with prefix 'model\.model\.' for module SmolMini; the module's names occur under \['model\.'\]",
        'model.model.',
    ),
    'prefix_too_short': Fault(
        _double_prefix,
        KeyError,
        r"no key starts with prefix 'model\.' for module SmolMini; the module's names occur under \['model\.model\.'\]",
    ),
    'no_prefix': Fault(
        lambda d: None,
        KeyError,
        r"no key is one of its names as they are \(prefix ''\) for module SmolMini; "
        r"the module's names occur under \['model\.'\]",
        '',
    ),
}


@pytest.mark.parametrize('kind', ['meta', 'materialized'])
@pytest.mark.parametrize('fault', list(FOLDER_FAULTS))
def test_damaged_checkpoint_folder(fault, kind, smol_src, tmp_path):
    f = FOLDER_FAULTS[fault]
    d = _copy(smol_src, tmp_path / 'ckpt')
    f.damage(d)
    m = _build(SmolMini, kind, torch.bfloat16)
    snap = _snapshot(m)
    with pytest.raises(f.exc) as ei:
        load_weights_from_hf_shards(d, [ModuleAndPrefix(m, f.prefix)])
    assert ei.type is f.exc
    assert re.search(f.match, _msg(ei.value)), _msg(ei.value)
    assert_unchanged(m, snap)


@pytest.mark.parametrize('kind', ['meta', 'materialized'])
@pytest.mark.parametrize('ckpt', list(CKPTS))
def test_undamaged_control(ckpt, kind, request):
    """The same small checkpoints load, and give safetensors' own tensors: the faults above are the only reason for
    the errors."""
    src, make, dtype, prefix = CKPTS[ckpt]
    d = request.getfixturevalue(src)
    m = _build(make, kind, dtype)
    [names] = load_weights_from_hf_shards(d, [ModuleAndPrefix(m, prefix)])
    ref = _real(d, read_weight_map(d))
    assert {prefix + n for n in names} == set(ref)
    assert_state_dict_equal(m, ref, prefix)


def test_index_is_truth_when_a_tensor_sits_in_two_shards(smol_src, tmp_path):
    """A merged shard that also holds a (different) copy of a tensor is never read for it: the index names one shard
    per key."""
    d = _copy(smol_src, tmp_path / 'ckpt')
    sd = load_file(str(d / SHARD1))
    sd['model.norm.weight'] = torch.full((576,), 7.0, dtype=torch.bfloat16)
    (d / SHARD1).unlink()
    save_file(sd, str(d / SHARD1))
    m = _build(SmolMini, 'meta', torch.bfloat16)
    load_weights_from_hf_shards(d, [ModuleAndPrefix(m, 'model.')])
    assert torch.equal(m.norm.weight, _real(smol_src, ['model.norm.weight'])['model.norm.weight'])


def test_identical_duplicate_in_weight_map_is_harmless(smol_src, tmp_path):
    d = _copy(smol_src, tmp_path / 'ckpt')
    text = (
        (d / INDEX_FILE)
        .read_text()
        .replace(
            f'"model.norm.weight": "{SHARD2}"', f'"model.norm.weight": "{SHARD2}", "model.norm.weight": "{SHARD2}"'
        )
    )
    _set_index(d, text)
    assert read_weight_map(d)['model.norm.weight'] == d / SHARD2


# ---------------------------------------------------------------- state_dicts in memory


@pytest.mark.parametrize('kind', ['meta', 'materialized'])
def test_state_dict_with_meta_tensor_is_refused(kind, smol_src):
    sd = _real(smol_src, read_weight_map(smol_src))
    sd['model.norm.weight'] = torch.empty(576, dtype=torch.bfloat16, device='meta')
    m = _build(SmolMini, kind, torch.bfloat16)
    snap = _snapshot(m)
    with pytest.raises(ValueError, match=r"state_dict\['model\.norm\.weight'\] is on meta"):
        load_weights(sd, m, 'model.')
    assert_unchanged(m, snap)


def test_state_dict_with_complex_tensor_for_real_parameter_is_refused():
    m = nn.Linear(2, 2)
    snap = _snapshot(m)
    with pytest.raises(
        ValueError, match=r"'weight' in state_dict is torch.complex64, which torch.float32 'weight' cannot hold"
    ):
        load_weights({'weight': torch.ones(2, 2, dtype=torch.complex64), 'bias': torch.ones(2)}, m)
    assert_unchanged(m, snap)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_state_dict_into_materialized_module_is_copied(dtype):
    """Same dtype takes the `get(out=...)` path; a source must honour `out` (it used to be ignored there, loading
    nothing)."""
    m = nn.Linear(3, 2).to(dtype)
    sd = {'weight': torch.arange(6.0).reshape(2, 3), 'bias': torch.tensor([7.0, 8.0])}
    w = m.weight
    assert load_weights(sd, m) == {'weight', 'bias'}
    assert m.weight is w
    assert torch.equal(m.weight, sd['weight'].to(dtype)) and torch.equal(m.bias, sd['bias'].to(dtype))


# ---------------------------------------------------------------- failures during the reads


def _truncate_on_first_read(monkeypatch, path: Path):
    """The file `path` loses its second half, in place, just before the load first reads from it: a download
    overwriting it mid-load."""
    real, done = mio.read_at, []

    def preadv(fd, views, pos, disk=None):
        if not done and os.path.samefile(f'/proc/self/fd/{fd}', path):
            done.append(fd)
            os.truncate(path, path.stat().st_size // 2)
        return real(fd, views, pos, disk)

    monkeypatch.setattr(mio, 'read_at', preadv)
    return done


def test_meta_module_unchanged_when_a_shard_is_cut_during_the_load(smol_src, tmp_path, monkeypatch):
    d = _copy(smol_src, tmp_path / 'ckpt')
    _rewrite(d / SHARD2, (d / SHARD2).read_bytes())
    _truncate_on_first_read(monkeypatch, d / SHARD2)
    m = _build(SmolMini, 'meta', torch.bfloat16)
    snap = _snapshot(m)
    with pytest.raises(ValueError, match=rf"{re.escape(SHARD2)}: tensor '.*' is cut short: read \d+ of \d+ bytes"):
        load_weights_from_hf_shards(d, [ModuleAndPrefix(m, 'model.')])
    assert_unchanged(m, snap)


def test_materialized_module_unchanged_when_a_new_tensor_read_fails(smol_src, tmp_path, monkeypatch):
    "New tensors (meta slots) are read before any materialized slot is overwritten, whatever the order of `modules`."
    d = _copy(smol_src, tmp_path / 'ckpt')
    _rewrite(d / SHARD2, (d / SHARD2).read_bytes())
    _truncate_on_first_read(monkeypatch, d / SHARD2)
    done = _build(SmolMini, 'materialized', torch.bfloat16).layers[0]  # shard 1: fine
    todo = _build(SmolMini, 'meta', torch.bfloat16).layers[1]  # shard 2: cut during the load
    snaps = _snapshot(done), _snapshot(todo)
    with pytest.raises(ValueError, match='is cut short'):
        load_weights_from_hf_shards(
            d, [ModuleAndPrefix(done, 'model.layers.0.'), ModuleAndPrefix(todo, 'model.layers.1.')]
        )
    assert_unchanged(done, snaps[0])
    assert_unchanged(todo, snaps[1])


@pytest.mark.skipif(sys.version_info < (3, 11), reason='exception notes need Python 3.11')
def test_materialized_module_cut_during_overwrite_says_so(smol_src, tmp_path, monkeypatch):
    """The one case that cannot be undone without a second copy of the weights: the error says how many tensors were
    overwritten."""
    d = _copy(smol_src, tmp_path / 'ckpt')
    _rewrite(d / SHARD2, (d / SHARD2).read_bytes())
    _truncate_on_first_read(monkeypatch, d / SHARD2)
    m = _build(SmolMini, 'materialized', torch.bfloat16)
    with pytest.raises(ValueError, match='is cut short') as ei:
        load_weights_from_hf_shards(d, [ModuleAndPrefix(m, 'model.')])
    assert any(
        re.search(r'\d+ of 19 materialized tensors were already overwritten; reload', n) for n in ei.value.__notes__
    ), ei.value.__notes__


# ---------------------------------------------------------------- generation_config.json

GEN = 'mstar_utils.generation'  # the logger load_generation_defaults warns on


def _gen(tmp_path, text: str, caplog) -> tuple[dict, str]:
    (tmp_path / 'generation_config.json').write_text(text)
    with caplog.at_level(logging.WARNING, logger=GEN):
        out = load_generation_defaults(tmp_path)
    return out, '\n'.join(r.getMessage() for r in caplog.records if r.name == GEN)


@pytest.mark.parametrize('text', ['[{"temperature": 0.7}]', '{"temperature": 0.7,', 'temperature = 0.7', '"0.7"'])
def test_generation_config_not_an_object_gives_no_defaults(text, tmp_path, caplog):
    out, log = _gen(tmp_path, text, caplog)
    assert out == {}
    assert str(tmp_path / 'generation_config.json') in log


@pytest.mark.parametrize('key', ['temperature', 'top_p', 'max_new_tokens', 'repetition_penalty'])
def test_generation_config_infinite_number_is_dropped(key, tmp_path, caplog):
    "1e999 parses as inf in Python's json: the value is dropped with a warning naming the key; the other keys stay."
    out, log = _gen(tmp_path, json.dumps({'top_k': 50})[:-1] + f', "{key}": 1e999}}', caplog)
    assert out == {'top_k': 50}
    assert f'{key} is inf' in log and 'generation_config.json' in log


@pytest.mark.parametrize(
    'text', ['{"max_new_tokens": ' + '9' * 5000 + '}', '[' * 100_000], ids=['5000_digit_int', 'nested_100000_deep']
)
def test_generation_config_json_python_cannot_parse(text, tmp_path, caplog):
    out, log = _gen(tmp_path, text, caplog)
    assert out == {} and 'generation_config.json' in log


# ---------------------------------------------------------------- tokenizer.json and token ids


def test_tokenizer_json_without_model_is_refused():
    tj = json.loads((tokenizer_folder('mistral-v3') / 'tokenizer.json').read_text(encoding='utf-8'))
    SentencePieceDetokenizer(tj)  # the whole file is fine
    del tj['model']
    with pytest.raises(ValueError, match=r"tokenizer\.json has no 'model'"):
        SentencePieceDetokenizer(tj)
    with pytest.raises(ValueError, match=r"'vocab' must map pieces to ids"):
        SentencePieceDetokenizer({'model': {'type': 'BPE', 'vocab': []}})
    with pytest.raises(ValueError, match='must be a parsed tokenizer.json'):
        SentencePieceDetokenizer([])


@pytest.fixture(scope='module')
def detokenizers():
    smol = ByteLevelDetokenizer(AutoTokenizer.from_pretrained(SMOL))
    tj = json.loads((tokenizer_folder('mistral-v3') / 'tokenizer.json').read_text(encoding='utf-8'))
    return {'byte-level': smol, 'sentencepiece': SentencePieceDetokenizer(tj)}


@pytest.mark.parametrize('which', ['byte-level', 'sentencepiece'])
@pytest.mark.parametrize(
    'bad', [-1, -(2**63), 'vocab', 2**63, 10**30, 3.0, 2.5, float('nan'), float('inf'), None, '7', True], ids=repr
)
def test_bad_token_id(which, bad, detokenizers):
    d = detokenizers[which]
    size = d.vocab_size
    if bad == 'vocab':
        bad = size
    for call in (lambda: d.token_bytes(bad), lambda: d.to_bytes([1, bad])):
        with pytest.raises(ValueError) as ei:
            call()
        msg = str(ei.value)
        assert ei.type is ValueError
        assert f'token id {bad if isinstance(bad, int) and not isinstance(bad, bool) else repr(bad)}' in msg, msg
        assert str(size) in msg, msg


def test_token_ids_in_a_float_tensor_are_refused(detokenizers):
    d = detokenizers['byte-level']
    with pytest.raises(ValueError, match=r'token id 5\.0 is a float.*49152'):
        d.to_bytes(torch.tensor([5.0]))
    assert d.vocab_size == 49152 and d.to_bytes(torch.tensor([5])) == d.token_bytes(5)
