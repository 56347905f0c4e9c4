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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    "Under pytest-xdist's `--dist loadgroup`, each file's tests share a worker, so its module fixtures are built once."
    # test_visible_cells' pages are independent processes, so they spread over the workers one by one.
    for item in items:
        if item.path.name != 'test_visible_cells.py':
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


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
