"""explore, the `inspect --stats` and `diff` commands, and robustness against files that cannot be parsed.

Expected values come from the checkpoints' own tensors (safetensors' load_file) and from load_model's model; the page
nbs/12b_explore.ipynb checks each section on its own.
"""
import io, json, math, shutil, contextlib
from pathlib import Path

import pytest, torch
from safetensors.torch import load_file, save_file

from importlib import import_module
from mstar_utils import explore, checkpoint_report

_explore = import_module('mstar_utils.explore')   # the module, whose function `explore` the top level exports
diff_checkpoints, weight_stats = _explore.diff_checkpoints, _explore.weight_stats
from mstar_utils.checkpoints import smollm2_checkpoint
from mstar_utils.cli import main

PERTURBED = {'model.layers.2.mlp.up_proj.weight': 2e-2, 'model.layers.11.self_attn.k_proj.weight': 5e-3, 'model.layers.25.mlp.down_proj.weight': 1e-3}


@pytest.fixture(scope='module')
def smol(): return smollm2_checkpoint()


@pytest.fixture(scope='module')
def tuned(smol, tmp_path_factory):
    "SmolLM2 with the three tensors of PERTURBED changed by noise of those sizes."
    out = Path(shutil.copytree(smol, tmp_path_factory.mktemp('tuned')/'smol-tuned'))
    wm = json.loads((out/'model.safetensors.index.json').read_text())['weight_map']
    g = torch.Generator().manual_seed(0)
    for shard in {wm[k] for k in PERTURBED}:
        sd = load_file(str(out/shard))
        for k, eps in PERTURBED.items():
            if k in sd: sd[k] = (sd[k].float() + eps * torch.randn(sd[k].shape, generator=g)).to(sd[k].dtype)
        save_file(sd, str(out/shard), metadata={'format': 'pt'})
    return out


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err): rc = main(list(map(str, argv)))
    return rc, out.getvalue(), err.getvalue()


def test_diff_ranks_the_perturbed_tensors_first(smol, tuned):
    d = diff_checkpoints(smol, tuned)
    want = sorted(PERTURBED, key=lambda k: -PERTURBED[k] / load_file(str(smol/json.loads((smol/'model.safetensors.index.json').read_text())['weight_map'][k]))[k].float().std())
    assert [t.key for t in d.changed] == want   # most changed first: the noise relative to each tensor's spread
    assert all(t.identical for t in d.tensors[3:]) and not (d.added or d.removed or d.reshaped)


def test_cli_diff_json_lists_changed_tensors_most_changed_first(smol, tuned):
    rc, out, _ = run_cli('diff', smol, tuned, '--json')
    assert rc == 0
    d = json.loads(out)
    assert {t['key'] for t in d['changed']} == set(PERTURBED)
    rel = [t['rel_l2'] for t in d['changed']]
    assert rel == sorted(rel, reverse=True) and len(d['identical']) == len(load_file_keys(smol)) - 3
    rc, out, _ = run_cli('diff', smol, tuned)
    assert rc == 0 and '3 tensors changed' in out
    rc, _, err = run_cli('diff', smol, smol.parent/'no-such-checkpoint')
    assert rc == 2 and 'no-such-checkpoint' in err


def load_file_keys(ckpt) -> list:
    return [k for f in sorted(Path(ckpt).glob('*.safetensors')) for k in load_file(str(f))]


def test_cli_inspect_stats_json(smol):
    rc, out, err = run_cli('inspect', smol, '--stats', '--json')
    assert rc == 0, err
    rep = json.loads(out)
    stats = {t['key']: t for t in rep['explore']['stats']['tensors']}
    assert set(stats) == set(load_file_keys(smol))
    ref = load_file(str(sorted(smol.glob('*.safetensors'))[0]))
    k, t = next(iter(ref.items()))
    assert math.isclose(stats[k]['absmax'], float(t.float().abs().max()))
    rc, out, _ = run_cli('inspect', smol, '--stats')
    assert rc == 0 and '6. Weight statistics' in out and '3. Will it load: yes' in out


def test_unparseable_files_become_findings(smol, tmp_path):
    "A broken tokenizer.json, generation_config.json and shard header each become a finding naming the file; the rest still renders."
    bad = Path(shutil.copytree(smol, tmp_path/'bad'))
    tok = json.loads((bad/'tokenizer.json').read_text())
    tok['model']['type'] = 'BPE2'
    (bad/'tokenizer.json').write_text(json.dumps(tok))
    (bad/'generation_config.json').write_text('{"eos_token_id": [2,')
    shard = sorted(bad.glob('*.safetensors'))[-1]
    shard.write_bytes(shard.read_bytes()[:64])
    e = explore(bad)
    assert {f.where for f in e.of('files')} == {'tokenizer.json', 'generation_config.json', shard.name}
    assert any(f.level == 'error' for f in e.of('load'))   # load_model refuses the cut shard
    readable = [k for f in sorted(smol.glob('*.safetensors'))[:-1] for k in load_file(str(f))]
    assert e.stats is not None and sorted(s.key for s in e.stats.tensors) == sorted(readable)
    html = e._repr_html_()
    assert 'tokenizer.json' in html and '<details' in html and json.loads(e.to_json())['checkpoint'] == 'bad'
    rep = checkpoint_report(bad)
    assert [p['file'] for p in rep['problems']] == [shard.name, 'tokenizer.json', 'generation_config.json']
    rc, out, err = run_cli('inspect', bad)
    assert rc == 0 and 'problem       tokenizer.json' in out, err


def test_weight_stats_hold_at_most_two_tensors(smol, monkeypatch):
    "The streaming reads one tensor ahead: never more than two of the source's tensors alive at once."
    import importlib, weakref
    ex = importlib.import_module('mstar_utils.explore')   # the module; the package's name `explore` is the function
    alive, peak, real = set(), [0], ex.FileSource.get
    def get(self, k, out=None):
        t = real(self, k, out)
        alive.add(id(t)); weakref.finalize(t, alive.discard, id(t)); peak[0] = max(peak[0], len(alive))
        return t
    monkeypatch.setattr(ex.FileSource, 'get', get)
    weight_stats(smol)
    assert 1 <= peak[0] <= 2, peak[0]
