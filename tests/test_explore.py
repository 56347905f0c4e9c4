"""explore, the `inspect --stats` and `diff` commands, and robustness against files that cannot be parsed.

Expected values come from the checkpoints' own tensors (safetensors' load_file) and from load_model's model; the page
nbs/12b_explore.ipynb checks each section on its own.
"""

import io
import json
import math
import shutil
import contextlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from importlib import import_module
from mstar_utils import explore, checkpoint_report
from mstar_utils.cli import main

_explore = import_module('mstar_utils.explore')  # the module, whose function `explore` the top level exports
diff_checkpoints, weight_stats = _explore.diff_checkpoints, _explore.weight_stats

PERTURBED = {
    'model.layers.2.mlp.up_proj.weight': 2e-2,
    'model.layers.11.self_attn.k_proj.weight': 5e-3,
    'model.layers.25.mlp.down_proj.weight': 1e-3,
}


@pytest.fixture(scope='module')
def tuned(smol_ckpt, tmp_path_factory):
    "SmolLM2 with the three tensors of PERTURBED changed by noise of those sizes."
    out = Path(shutil.copytree(smol_ckpt, tmp_path_factory.mktemp('tuned') / 'smol-tuned'))
    wm = json.loads((out / 'model.safetensors.index.json').read_text())['weight_map']
    g = torch.Generator().manual_seed(0)
    for shard in {wm[k] for k in PERTURBED}:
        sd = load_file(str(out / shard))
        for k, eps in PERTURBED.items():
            if k in sd:
                sd[k] = (sd[k].float() + eps * torch.randn(sd[k].shape, generator=g)).to(sd[k].dtype)
        save_file(sd, str(out / shard), metadata={'format': 'pt'})
    return out


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(map(str, argv)))
    return rc, out.getvalue(), err.getvalue()


def test_diff_ranks_the_perturbed_tensors_first(smol_ckpt, tuned):
    d = diff_checkpoints(smol_ckpt, tuned)
    want = sorted(
        PERTURBED,
        key=lambda k: (
            -PERTURBED[k]
            / load_file(
                str(smol_ckpt / json.loads((smol_ckpt / 'model.safetensors.index.json').read_text())['weight_map'][k])
            )[k]
            .float()
            .std()
        ),
    )
    assert [t.key for t in d.changed] == want  # most changed first: the noise relative to each tensor's spread
    assert all(t.identical for t in d.tensors[3:]) and not (d.added or d.removed or d.reshaped)


def test_diff_of_a_checkpoint_with_itself_lists_its_layers_in_order(smol_ckpt):
    """Unchanged layers tie, and stand in the model's order (layers.2 before layers.10), with no empty table of
    changed tensors above them."""
    from transformers import AutoConfig

    n = AutoConfig.from_pretrained(smol_ckpt).num_hidden_layers
    d = diff_checkpoints(smol_ckpt, smol_ckpt)
    blocks = [row.layer for row in d.layers if row.layer.startswith('model.layers.')]
    assert blocks == [f'model.layers.{i}' for i in range(n)]
    rc, out, _ = run_cli('diff', smol_ckpt, smol_ckpt)
    assert rc == 0 and 'max |a−b|  rel L2  cosine' not in out
    assert out.splitlines()[1].split() == ['layer', 'tensors', 'changed', 'rel', 'L2', 'max', '|a−b|']


def test_cli_diff_json_lists_changed_tensors_most_changed_first(smol_ckpt, tuned):
    rc, out, _ = run_cli('diff', smol_ckpt, tuned, '--json')
    assert rc == 0
    d = json.loads(out)
    assert {t['key'] for t in d['changed']} == set(PERTURBED)
    rel = [t['rel_l2'] for t in d['changed']]
    assert rel == sorted(rel, reverse=True) and len(d['identical']) == len(load_file_keys(smol_ckpt)) - 3
    rc, out, _ = run_cli('diff', smol_ckpt, tuned)
    assert rc == 0 and '3 tensors changed' in out
    rc, _, err = run_cli('diff', smol_ckpt, smol_ckpt.parent / 'no-such-checkpoint')
    assert rc == 2 and 'no-such-checkpoint' in err


def load_file_keys(ckpt) -> list:
    return [k for f in sorted(Path(ckpt).glob('*.safetensors')) for k in load_file(str(f))]


def test_cli_inspect_stats_json(smol_ckpt):
    rc, out, err = run_cli('inspect', smol_ckpt, '--stats', '--json')
    assert rc == 0, err
    rep = json.loads(out)
    stats = {t['key']: t for t in rep['explore']['stats']['tensors']}
    assert set(stats) == set(load_file_keys(smol_ckpt))
    ref = load_file(str(sorted(smol_ckpt.glob('*.safetensors'))[0]))
    k, t = next(iter(ref.items()))
    assert math.isclose(stats[k]['absmax'], float(t.float().abs().max()))
    rc, out, _ = run_cli('inspect', smol_ckpt, '--stats')
    assert rc == 0 and '6. Weight statistics' in out and '3. Will it load: yes' in out


def test_unparseable_files_become_findings(smol_ckpt, tmp_path):
    """A broken tokenizer.json, generation_config.json and shard header each become a finding naming the file; the
    rest still renders."""
    bad = Path(shutil.copytree(smol_ckpt, tmp_path / 'bad'))
    tok = json.loads((bad / 'tokenizer.json').read_text())
    tok['model']['type'] = 'BPE2'
    (bad / 'tokenizer.json').write_text(json.dumps(tok))
    (bad / 'generation_config.json').write_text('{"eos_token_id": [2,')
    shard = sorted(bad.glob('*.safetensors'))[-1]
    shard.write_bytes(shard.read_bytes()[:64])
    e = explore(bad)
    assert {f.where for f in e.of('files')} == {'tokenizer.json', 'generation_config.json', shard.name}
    assert any(f.level == 'error' for f in e.of('load'))  # load_model refuses the cut shard
    readable = [k for f in sorted(smol_ckpt.glob('*.safetensors'))[:-1] for k in load_file(str(f))]
    assert e.stats is not None and sorted(s.key for s in e.stats.tensors) == sorted(readable)
    html = e._repr_html_()
    assert 'tokenizer.json' in html and '<details' in html and json.loads(e.to_json())['checkpoint'] == 'bad'
    rep = checkpoint_report(bad)
    assert [p['file'] for p in rep['problems']] == [shard.name, 'tokenizer.json', 'generation_config.json']
    rc, out, err = run_cli('inspect', bad)
    assert rc == 0 and 'problem       tokenizer.json' in out, err


def test_weight_stats_hold_at_most_two_tensors(smol_ckpt, monkeypatch):
    "The streaming reads one tensor ahead: never more than two of the source's tensors alive at once."
    import importlib
    import weakref

    ex = importlib.import_module('mstar_utils.explore_weights')  # the module that reads the weights
    alive, peak, real = set(), [0], ex.FileSource.get

    def get(self, k, out=None):
        t = real(self, k, out)
        alive.add(id(t))
        weakref.finalize(t, alive.discard, id(t))
        peak[0] = max(peak[0], len(alive))
        return t

    monkeypatch.setattr(ex.FileSource, 'get', get)
    weight_stats(smol_ckpt)
    assert 1 <= peak[0] <= 2, peak[0]


# 4. Bytes per rank: every figure is load_plan's, the dry run of load_model at that rank; the expected bytes below come
# from load_plan's own (detailed) plans and from the checkpoints' headers.


def _ranks(ckpt) -> list:
    """explore's section 4 of `ckpt`, as it builds it: the model built on meta once, every rank planned over copies
    of it."""
    config, model = _explore._build(Path(ckpt), [])
    rows, _ = _explore.rank_table(Path(ckpt), config, model)
    return rows


def _header_bytes(ckpt) -> dict:
    """{key: (shape, dtype, nbytes)} from the safetensors headers of `ckpt`, parsed as the format specifies (u64
    length, JSON)."""
    out = {}
    for f in sorted(Path(ckpt).glob('*.safetensors')):
        with open(f, 'rb') as fh:
            head = json.loads(fh.read(int.from_bytes(fh.read(8), 'little')))
        for k, v in head.items():
            if k != '__metadata__':
                out[k] = (v['shape'], v['dtype'], v['data_offsets'][1] - v['data_offsets'][0])
    return out


def test_rank_bytes_are_load_plan_totals_on_smollm2(smol_ckpt):
    from mstar_utils.model import load_plan

    rows = _ranks(smol_ckpt)
    assert [(r.world_size, r.expert_parallel, r.refused) for r in rows] == [
        (1, False, ''),
        (2, False, ''),
        (4, False, ''),
        (8, False, ''),
    ]
    # the full plan at 1 and 2 ranks; at 4 and 8 its totals alone (03_load_model checks they agree), each built afresh
    for r in rows:
        plans = [load_plan(smol_ckpt, k, r.world_size, detail=r.world_size <= 2) for k in range(r.world_size)]
        assert r.read_bytes == [p.total_bytes for p in plans] and r.held_bytes == [p.held_bytes for p in plans], (
            r.world_size
        )
    assert rows[0].read_bytes == [sum(n for _, _, n in _header_bytes(smol_ckpt).values())]


@pytest.fixture(scope='module')
def moe6(tmp_path_factory):
    "A tiny Qwen3-MoE with 6 experts, saved by transformers."
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
    )
    out = tmp_path_factory.mktemp('moe6') / 'qwen3-moe-6'
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def test_six_experts_on_four_ranks_split_2_2_1_1(moe6):
    ep4 = next(r for r in _ranks(moe6) if r.expert_parallel and r.world_size == 4)
    assert not ep4.refused
    # bytes of one expert, from the headers: per-expert keys, or a fused [6, ...] tensor per projection
    experts = {k: v for k, v in _header_bytes(moe6).items() if '.mlp.experts.' in k}
    per_expert = {}
    for k, (_shape, _, n) in experts.items():
        idx = k.split('.mlp.experts.')[1].split('.')[0]
        for e in [int(idx)] if idx.isdigit() else range(6):
            per_expert[e] = per_expert.get(e, 0) + (n if idx.isdigit() else n // 6)
    assert len(set(per_expert.values())) == 1
    one = per_expert[0]
    counts = [2, 2, 1, 1]  # vLLM's split: the first 6 % 4 ranks take one more
    for got in (ep4.read_bytes, ep4.held_bytes):  # bf16 stored and held: an expert reads and holds the same bytes
        assert [g - c * one for g, c in zip(got, counts, strict=True)] == [got[0] - 2 * one] * 4, (
            got
        )  # the rest is the same on every rank
        assert got[0] == got[1] > got[2] == got[3]


@pytest.fixture(scope='module')
def fp8_llama(tmp_path_factory):
    "A tiny Llama in fp8 with 16 x 16 blocks: its MLP (80 rows) cuts at row 40 under TP 2, inside a block."
    from transformers import LlamaConfig, LlamaForCausalLM
    from mstar_utils.testing import write_fp8_checkpoint

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    return write_fp8_checkpoint(LlamaForCausalLM(cfg), tmp_path_factory.mktemp('fp8') / 'llama-fp8', block=(16, 16))


def test_fp8_blocks_straddling_a_cut_are_read_by_both_ranks(fp8_llama):
    from mstar_utils.model import load_plan

    B, heads = 16, _header_bytes(fp8_llama)
    tp2 = next(r for r in _ranks(fp8_llama) if r.world_size == 2)
    plans = [load_plan(fp8_llama, k, 2) for k in range(2)]
    assert tp2.read_bytes == [p.total_bytes for p in plans]

    def want(p) -> int:
        """Bytes rank `p` reads, from the headers: whole keys, its share of a cut bf16 key, the whole blocks its rows
        of an fp8 key touch."""
        n = 0
        for t in p.tensors:
            for k in t.keys:
                shape, dtype, nbytes = heads[k]
                if t.slice is None:
                    n += nbytes
                    continue
                ((a, b),) = t.slice.ranges
                d, size = t.slice.dim, t.shape[t.slice.dim] * 2  # the whole dim: two ranks' equal shares
                if dtype == 'F8_E4M3':
                    n += (min(-(-b // B) * B, size) - a // B * B) * nbytes // size
                elif k.endswith('_scale_inv'):
                    n += (-(-b // B) - a // B) * nbytes // shape[d]
                else:
                    n += (b - a) * nbytes // size
        return n

    assert tp2.read_bytes == [want(p) for p in plans]
    share = plans[0].checkpoint_bytes + sum(heads[k][2] for t in plans[0].tensors if t.slice is None for k in t.keys)
    straddled = [
        t
        for t in plans[0].tensors
        if t.slice is not None and heads[t.keys[0]][1] == 'F8_E4M3' and t.slice.ranges[0][1] % B
    ]
    assert {t.name.split('.')[-2] for t in straddled} == {'gate_proj', 'up_proj', 'down_proj'}
    block_rows = sum(
        heads[t.keys[0]][2] // (heads[t.keys[0]][0][t.slice.dim] // B)
        + heads[t.keys[1]][2] // heads[t.keys[1]][0][t.slice.dim]
        for t in straddled
    )  # one row of blocks (and of scales) of each straddled tensor
    assert sum(tp2.read_bytes) - share == block_rows > 0


# Folders with files missing, empty or cut short: each is a finding naming the file, and the rest still renders. The
# expected keys come from the shards that remain, read by safetensors' load_file.


@pytest.fixture(scope='module')
def broken(smol_ckpt, tmp_path_factory) -> dict:
    "{case: folder}: a tiny Qwen2 saved by transformers, then emptied, thinned, cut or left dangling."
    from mstar_utils.testing import save_tiny

    root = tmp_path_factory.mktemp('broken')
    one = save_tiny('qwen2', root / 'one', max_shard_size='10MB')  # model.safetensors alone
    sharded = save_tiny('qwen2', root / 'sharded')  # shards behind an index
    out = {name: root / name for name in ('empty', 'safetensors-only', 'tokenizer-only')}
    for p in out.values():
        p.mkdir()
    shutil.copy(one / 'model.safetensors', out['safetensors-only'])
    shutil.copy(smol_ckpt / 'tokenizer.json', out['tokenizer-only'])
    out['dangling'] = Path(shutil.copytree(sharded, root / 'dangling'))
    sorted(out['dangling'].glob('*.safetensors'))[-1].unlink()  # the index still names it
    out['truncated'] = Path(shutil.copytree(one, root / 'truncated'))
    f = out['truncated'] / 'model.safetensors'
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return out


def readable_keys(folder) -> set:
    "Keys of the shards in `folder` that safetensors reads whole."
    out = set()
    for f in Path(folder).glob('*.safetensors'):
        with contextlib.suppress(Exception):
            out |= set(load_file(str(f)))
    return out


def test_a_folder_without_weights_or_config_is_findings(broken):
    for case in ('empty', 'tokenizer-only'):
        e = explore(broken[case])
        files = {f.where: f for f in e.of('files')}
        assert set(files) == {'model.safetensors', 'config.json'}, case  # tokenizer.json parses
        assert 'neither model.safetensors.index.json nor model.safetensors' in files['model.safetensors'].what
        assert files['config.json'].what.startswith('missing') and files['config.json'].fix
        assert [f.where for f in e.of('load') if f.level == 'error'] == ['config.json']
        assert e.tree.tensors == 0 and e.stats is not None and e.stats.tensors == []
        assert 'config.json' in str(e) and 'config.json' in e._repr_html_()
        assert json.loads(e.to_json())['checkpoint'] == case


def test_safetensors_without_config_is_explored_from_the_shards(broken):
    e = explore(broken['safetensors-only'])
    assert [(f.where, f.what[:7]) for f in e.of('files')] == [('config.json', 'missing')]
    assert [f.where for f in e.of('load') if f.level == 'error'] == ['config.json']  # not "it loads"
    keys = readable_keys(broken['safetensors-only'])
    assert e.tree.tensors == len(keys) and {s.key for s in e.stats.tensors} == keys
    assert '3. Will it load: no' in str(e)


def test_dangling_index_and_truncated_shard_are_one_finding_each(broken):
    e = explore(broken['dangling'])
    index = json.loads((broken['dangling'] / 'model.safetensors.index.json').read_text())
    gone = sorted(set(index['weight_map'].values()))[-1]
    files = e.of('files')
    assert [f.where for f in files] == ['model.safetensors.index.json'] and gone in files[0].what
    keys = readable_keys(broken['dangling'])
    assert e.tree.tensors == len(keys) and {s.key for s in e.stats.tensors} == keys  # the shards still there
    e = explore(broken['truncated'])
    files = e.of('files')
    assert [f.where for f in files] == ['model.safetensors'] and 'cut short' in files[0].what
    assert any(f.level == 'error' for f in e.of('load')) and e.tree.tensors == 0
    assert json.loads(e.to_json())['findings'][0]['where'] == 'model.safetensors'


@pytest.mark.parametrize('case', ['safetensors-only', 'dangling', 'truncated'])
def test_cli_inspect_stats_reports_a_broken_folder(broken, case):
    rc, out, err = run_cli('inspect', broken[case], '--stats', '--json')
    assert rc == 0, err
    rep = json.loads(out)
    named = {'safetensors-only': 'config.json', 'dangling': 'model.safetensors.index.json'}
    assert [p['file'] for p in rep['problems']][:1] == [named.get(case, 'model.safetensors')]
    keys = readable_keys(broken[case])
    assert rep['tensors'] == len(keys) and {t['key'] for t in rep['explore']['stats']['tensors']} == keys
    assert named.get(case, 'model.safetensors') in {f['where'] for f in rep['explore']['findings']}
    rc, out, err = run_cli('inspect', broken[case], '--stats')
    assert rc == 0 and 'problem       ' in out and '6. Weight statistics' in out, err


@pytest.mark.parametrize('case', ['empty', 'tokenizer-only'])
def test_cli_inspect_stats_refuses_a_folder_without_weights_in_one_line(broken, case):
    rc, out, err = run_cli('inspect', broken[case], '--stats')
    assert rc == 2 and out == '' and len(err.strip().splitlines()) == 1
    assert str(broken[case]) in err and 'neither model.safetensors.index.json nor model.safetensors' in err


# A dtype change is reported as one: the expected categories come from the two checkpoints' tensors as safetensors'
# load_file reads them.


def test_diff_reports_a_cast_as_retyped(tmp_path):
    from mstar_utils.testing import save_tiny

    a = save_tiny('qwen2', tmp_path / 'a', max_shard_size='10MB')
    b = Path(shutil.copytree(a, tmp_path / 'b'))
    sd = load_file(str(b / 'model.safetensors'))
    norm, proj = 'model.norm.weight', 'model.layers.0.mlp.up_proj.weight'
    sd[norm] = sd[norm].to(torch.bfloat16)  # ones: the cast keeps every value
    sd[proj] = sd[proj].to(torch.bfloat16)  # random floats: the cast rounds them
    save_file(sd, str(b / 'model.safetensors'), metadata={'format': 'pt'})
    ra, rb = load_file(str(a / 'model.safetensors')), load_file(str(b / 'model.safetensors'))
    retyped = {k for k in ra if ra[k].dtype != rb[k].dtype and torch.equal(ra[k].float(), rb[k].float())}
    changed = {k for k in ra if not torch.equal(ra[k].float(), rb[k].float())}
    assert retyped == {norm} and changed == {proj}  # the reference's categories
    d = diff_checkpoints(a, b)
    assert [t.key for t in d.retyped] == [norm] and {t.key for t in d.changed} == changed
    assert (d.retyped[0].dtype_a, d.retyped[0].dtype_b) == ('float32', 'bfloat16') and not d.retyped[0].identical
    rc, out, _ = run_cli('diff', a, b, '--json')
    j = json.loads(out)
    assert rc == 0 and j['retyped'] == [{'key': norm, 'dtype_a': 'float32', 'dtype_b': 'bfloat16'}]
    assert [t['key'] for t in j['changed']] == [proj] and norm not in j['identical']
    assert (j['changed'][0]['dtype_a'], j['changed'][0]['dtype_b']) == ('float32', 'bfloat16')
    want = float((ra[proj] - rb[proj].float()).abs().max())
    assert j['changed'][0]['max_abs'] == want
    rc, out, _ = run_cli('diff', a, b)
    assert rc == 0 and f'1 tensors changed, {len(ra) - 2} identical, 1 retyped' in out
    assert f'retyped, values equal: {norm} float32 → bfloat16' in out
    assert next(line for line in out.splitlines() if line.strip().startswith(proj)).split()[1:4] == [
        'float32',
        '→',
        'bfloat16',
    ]
