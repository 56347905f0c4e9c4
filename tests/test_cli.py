"The `mstar-utils` console script, run as a user runs it: a subprocess on the real SmolLM2 checkpoint."
import json, os, subprocess, sys

import pytest
from mstar_utils import smollm2_checkpoint

ENV = {**os.environ, 'HF_HUB_OFFLINE': '1'}


def run(*args):
    return subprocess.run(['mstar-utils', *args], capture_output=True, text=True, env=ENV, timeout=300)


def test_report_json_matches_checkpoint():
    r = run('inspect', str(smollm2_checkpoint()), '--json')
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    idx = json.loads((smollm2_checkpoint()/'model.safetensors.index.json').read_text())
    assert rep['tensors'] == len(idx['weight_map'])
    assert sorted(s['file'] for s in rep['shards']) == sorted(set(idx['weight_map'].values()))
    assert rep['tokenizer']['kind'] == 'byte-level BPE' and rep['stop_token_ids'] == [2]
    assert rep['kv']['kv_bytes_per_token'] == 2 * 30 * 3 * 64 * 2


@pytest.mark.parametrize('folder', ['/nonexistent/ckpt', '/tmp'])
def test_not_a_checkpoint_is_one_line_exit_2(folder):
    r = run('inspect', folder)
    assert r.returncode == 2
    assert r.stdout == '' and len(r.stderr.strip().splitlines()) == 1 and 'Traceback' not in r.stderr
    assert folder in r.stderr


def test_kv_check_verdict_and_plot(tmp_path):
    png = tmp_path/'kv.png'
    r = run('inspect', '--kv-pages', '2048', '--max-concurrent-requests', '4', '--plot', str(png))
    assert r.returncode == 1 and 'refused' in r.stdout and 'largest max_concurrent_requests that fits is 3' in r.stdout
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    r = run('inspect', '--kv-pages', '2049', '--max_concurrent_requests', '4')
    assert r.returncode == 0 and 'KV check (2049 pages, max_concurrent_requests 4): warning' in r.stdout


def test_prompt_answers_paris_through_our_loader():
    r = run('inspect', '--prompt', 'What is the capital of France?', '--max-new-tokens', '24')
    assert r.returncode == 0, r.stderr
    reply = r.stdout.split('reply', 1)[1]
    assert 'Paris' in reply
