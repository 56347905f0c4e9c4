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

    ex = importlib.import_module('mstar_utils.explore')  # the module; the package's name `explore` is the function
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
