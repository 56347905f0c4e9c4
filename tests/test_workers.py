"""How tools/test spreads the suite over pytest-xdist's workers: each test file on one worker, so a module fixture
that builds something in the repository (the docs site) is built by one process, once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CONFTEST = f'''
import importlib.util
spec = importlib.util.spec_from_file_location('project_conftest', {str(TESTS / 'conftest.py')!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
pytest_xdist_make_scheduler = mod.pytest_xdist_make_scheduler
'''

RECORD = '''
import json, os, time, pytest
@pytest.mark.parametrize('i', range(6))
def test_record(i, request):
    time.sleep(1 if 'visible' in request.node.path.name else 0)  # slow pages: both workers take some
    with open(os.environ['WHO_RAN'], 'a') as f:
        f.write(json.dumps([request.node.path.name, os.environ['PYTEST_XDIST_WORKER']]) + '\\n')
'''


def test_each_file_runs_on_one_worker_and_visible_cells_spread(tmp_path):
    pytest.importorskip('xdist')
    (tmp_path / 'conftest.py').write_text(CONFTEST)
    for name in ('test_one.py', 'test_two.py', 'test_three.py', 'test_visible_cells.py'):
        (tmp_path / name).write_text(RECORD)
    who = tmp_path / 'who.jsonl'
    r = subprocess.run(
        [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-n', '2', '--dist', 'loadscope', '.'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, 'WHO_RAN': str(who)},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = [json.loads(line) for line in who.read_text().splitlines()]
    assert len(ran) == 24, ran
    workers = {}
    for name, worker in ran:
        workers.setdefault(name, set()).add(worker)
    assert all(len(workers[n]) == 1 for n in ('test_one.py', 'test_two.py', 'test_three.py')), workers
    assert len(workers['test_visible_cells.py']) == 2, workers  # its pages, one scope each, spread
