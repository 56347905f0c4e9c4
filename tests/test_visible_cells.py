"""Every documentation page runs as a reader runs it: its visible cells alone, in order, in a fresh kernel.

A cell is visible when the docs show its source: not `#| hide`, not `#| exporti` (exported, hidden). Cells marked
`#| gpu` run only with CUDA and `#| slow` ones only with `--flags slow` in nbdev_test's sense (MSTAR_SLOW=1), as
nbdev_test skips them. Each page runs in its own Python process, so nothing one page imports or sets leaks into
another."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'
HIDDEN = re.compile(r'^\s*#\|\s*(hide|exporti|eval:\s*false)\b', re.M)
SKIP = re.compile(r'^\s*#\|\s*(gpu|slow)\b', re.M)

RUNNER = r'''
import json, re, sys
from execnb.nbio import read_nb
from execnb.shell import CaptureShell
path, skip_flags = sys.argv[1], set(sys.argv[2:])
hidden = re.compile(r'^\s*#\|\s*(hide|exporti|eval:\s*false)\b', re.M)
flag = re.compile(r'^\s*#\|\s*(gpu|slow)\b', re.M)
nb = read_nb(path)
sh = CaptureShell(path)
for i, c in enumerate(nb.cells):
    if c.cell_type != 'code' or hidden.search(c.source): continue
    m = flag.search(c.source)
    if m and m[1] in skip_flags: continue
    sh.run(c.source)
    if sh.exc:
        print(f'cell {i} failed: {type(sh.exc).__name__}: {sh.exc}\n--- source ---\n{c.source[:1500]}', file=sys.stderr)
        sys.exit(1)
'''


def pages():
    from nbdev.doclinks import nbglob

    return sorted(Path(p).name for p in nbglob(NBS))


@pytest.mark.parametrize('nb', pages())
def test_visible_cells_run_in_a_fresh_kernel(nb):
    import torch

    skip = ([] if torch.cuda.is_available() else ['gpu']) + ([] if os.environ.get('MSTAR_SLOW') else ['slow'])
    # TMPDIR: the page's scratch folders go with the test. A short path (not pytest's tmp_path), since
    # multiprocessing puts its AF_UNIX sockets there and a socket's path is at most 107 bytes.
    scratch = tempfile.mkdtemp(prefix='vc-')
    env = {
        **os.environ,
        'HF_HUB_OFFLINE': '1',
        'TOKENIZERS_PARALLELISM': 'false',
        'MPLBACKEND': 'Agg',
        'TMPDIR': scratch,
    }
    try:
        r = subprocess.run(
            [sys.executable, '-c', RUNNER, str(NBS / nb), *skip],
            cwd=NBS,
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-4000:]


def test_a_page_opens_with_a_visible_import_cell():
    "The first visible code cell after the title and default_exp imports something a reader can copy."
    bad = []
    for nb in pages():
        if nb == 'index.ipynb':
            continue
        cells = [c for c in json.loads((NBS / nb).read_text(encoding='utf-8'))['cells'] if c['cell_type'] == 'code']
        src = [''.join(c['source']) for c in cells]
        visible = [
            s for s in src if not HIDDEN.search(s) and not s.lstrip().startswith(('#| default_exp', '#| export'))
        ]
        if not visible or not re.search(r'^\s*(from|import)\s', visible[0], re.M):
            bad.append(nb)
    assert bad == [], bad
