"""`load_generation_defaults` against vLLM's default sampling parameters (`ModelConfig.get_diff_sampling_param`,
`generation_config='auto'`) on the real generation_config.json files the project's checkpoints ship."""

import pytest

from mstar_utils.checkpoints import smollm2_checkpoint, whisper_checkpoint
from mstar_utils.generation import load_generation_defaults

CHECKPOINTS = {'SmolLM2-135M-Instruct': smollm2_checkpoint, 'whisper-tiny.en': whisper_checkpoint}


@pytest.mark.parametrize('name', list(CHECKPOINTS))
def test_defaults_equal_vllm(name):
    from vllm.config import ModelConfig

    folder = CHECKPOINTS[name]()
    assert (folder / 'generation_config.json').exists()
    vllm_defaults = ModelConfig(model=str(folder), generation_config='auto').get_diff_sampling_param()
    ours = load_generation_defaults(folder)
    ours = {('max_tokens' if k == 'max_output_tokens' else k): v for k, v in ours.items()}
    assert ours == vllm_defaults
