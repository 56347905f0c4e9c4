"""Session fixtures the test files share: the checkpoints several of them load, built once per run, at first use.

A test that needs SmolLM2 asks for `smol_ckpt` (its folder) or `smol_config` (its transformers config) instead of
building the checkpoint when pytest imports the file."""

import json
import sys
from pathlib import Path

import pytest

NBS = Path(__file__).resolve().parents[1] / 'nbs'


@pytest.fixture(scope='session')
def smol_ckpt():
    "SmolLM2-135M-Instruct's checkpoint folder, built from its registry package on first use."
    from mstar_utils.checkpoints import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope='session')
def smol_config(smol_ckpt):
    "SmolLM2's config, as transformers reads it."
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(smol_ckpt)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    "Under pytest-xdist's `--dist loadscope`, each test file runs on one worker, so its module fixtures are built once."
    # The scope is the file, except for test_visible_cells, whose pages are independent processes spread one by one.
    # (Not `--dist loadgroup`: since pytest 9.2 a test's id no longer takes the group suffix xdist 3.8 writes into it,
    # so the groups are silently ignored and a file's tests split over workers.)
    if config.getvalue('dist') != 'loadscope':
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split('::', 1)[0]
            return nodeid if path.endswith('test_visible_cells.py') else path

    return ByFile(config, log)


def notebooks() -> list[Path]:
    "The notebooks nbdev renders (nbdev's own glob: no `_` or `.` files or folders)."
    from nbdev.doclinks import nbglob

    return sorted(Path(p) for p in nbglob(NBS))


def cells(nb: Path) -> list[dict]:
    return json.loads(nb.read_text(encoding='utf-8'))['cells']


def src(cell: dict) -> str:
    return ''.join(cell['source'])


# The `mstar-utils` console script installed beside the running interpreter: the tests run it as a user does, and find
# it even when the venv is used without being activated (its bin/ not on PATH).
CLI = str(Path(sys.executable).parent / 'mstar-utils')
