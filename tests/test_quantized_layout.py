"""The bits per weight a layout picture states equal what `explore` reports for the same layer, on every format.

`layout_bits` counts dtype × shape of the tensors `stored_layout` reads from the headers; `explore`'s formats table
counts the header's byte ranges of the tensors the format's op reads, over the weights the op decodes to."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from mstar_utils.explore import format_families, quantized_units, stored_tensors
from mstar_utils.quantized import layout_bits, stored_layout
from mstar_utils.sources import checkpoint_source
from mstar_utils.testing import (
    formats_config,
    write_bnb_checkpoint,
    write_ct_preset_checkpoint,
    write_fp8_checkpoint,
    write_int4_checkpoint,
    write_quantized_checkpoint,
)


def _model(dtype):
    return AutoModelForCausalLM.from_config(formats_config(), dtype=dtype)


WRITERS = {
    'fp8': lambda d: write_fp8_checkpoint(_model(torch.float32), d),
    'ct_fp8': lambda d: write_ct_preset_checkpoint(_model(torch.bfloat16), d, 'FP8_DYNAMIC'),
    'ct_w4a16': lambda d: write_ct_preset_checkpoint(_model(torch.bfloat16), d, 'W4A16'),
    'dense': lambda d: write_ct_preset_checkpoint(_model(torch.bfloat16), d, 'W4A16', compress=False),
    'nvfp4': lambda d: write_ct_preset_checkpoint(_model(torch.bfloat16), d, 'NVFP4A16'),
    'mxfp8': lambda d: write_ct_preset_checkpoint(_model(torch.bfloat16), d, 'MXFP8A16'),
    'mxfp4': lambda d: write_quantized_checkpoint('mxfp4', d),
    'gptq': lambda d: write_int4_checkpoint(_model(torch.float32), d, 'gptq', group_size=32, act_order=True)[0],
    'awq': lambda d: write_int4_checkpoint(_model(torch.float32), d, 'awq', group_size=32)[0],
    'bnb_nf4': lambda d: write_bnb_checkpoint(_model(torch.float32), d, 'nf4', True),
    'bnb_fp4': lambda d: write_bnb_checkpoint(_model(torch.float32), d, 'fp4'),
    'bnb_int8': lambda d: write_bnb_checkpoint(_model(torch.float32), d, 'int8'),
}


@pytest.mark.parametrize('fmt', sorted(WRITERS))
def test_layout_bits_equal_explore(fmt, tmp_path):
    d = WRITERS[fmt](tmp_path / fmt)
    config, tensors = json.loads((d / 'config.json').read_text()), stored_tensors(d)
    units = quantized_units(d, config, tensors, [])
    family = 'model.layers.*.mlp.down_proj.weight' if fmt != 'mxfp4' else 'model.layers.*.mlp.experts.down_proj'
    members = [u for u in units if u.target.replace('.0.', '.*.').replace('.1.', '.*.') == family]
    assert len(members) == 2  # both layers: the family explore reports (bitsandbytes' quant state differs by a byte)
    src, bits, weights = checkpoint_source(d), 0.0, 0
    for u in members:
        keys = (*u.sources, *u.dropped)  # with what was read to build the op: a g_idx, a quant state blob
        stored = {k: v for k, v in stored_layout(src, '').items() if k in keys}
        assert sorted(stored) == sorted(keys)
        n = math.prod(u.op.out_shape(u.shapes))
        bits, weights = bits + layout_bits(stored, n) * n, weights + n
    want = next(f.bits_per_weight for f in format_families(tensors, units) if f.family == family)
    assert bits / weights == pytest.approx(want, rel=1e-12)
