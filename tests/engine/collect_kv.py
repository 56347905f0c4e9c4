"""Start vLLM (CPU, `load_format='dummy'`) on tiny configs of many architectures and record its KV cache figures.

Run in the engine venv (`tools/engine --collect-kv`): writes tests/engine/kv_figures.json, which the normal suite
(tests/test_kv_vllm.py) compares `vllm_concurrency` against. Each config is built with transformers' own config class
and saved as config.json; vLLM reads only the config (dummy weights). Every (budget, max_model_len) is a fresh engine in
this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); the figures are what it stores beside its log line "CPU KV cache
size: N tokens, Maximum concurrency for L tokens per request: Xx": `cache_config.num_gpu_blocks`, `block_size`,
`kv_cache_size_tokens` and `kv_cache_max_concurrency`. An architecture the CPU backend cannot build is recorded with
its error.
"""

import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'
os.environ.pop('VLLM_CPU_KVCACHE_SPACE', None)  # it would override kv_cache_memory_bytes
OUT = Path(os.environ.get('MSTAR_KV_OUT') or Path(__file__).with_name('kv_figures.json'))  # another file: a split run
BUDGETS = (2**30, 3 * 2**29)  # bytes of KV
LENS = (1024, 4096)  # max_model_len
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32 (it refuses 16: "No common block size")

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
SMALL_POS = dict(max_position_embeddings=8192)


def configs():
    "(name, transformers config) of each architecture, tiny, with `architectures` naming vLLM's class."
    import transformers as T

    def c(cls, arch, **kw):
        args = {**SMALL, **SMALL_POS, **kw}
        args = {k: v for k, v in args.items() if v is not None}
        cfg = getattr(T, cls)(**args)
        cfg.architectures = [arch]
        cfg.dtype = 'bfloat16'
        return cfg

    mla = dict(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    moe = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
    yield 'Llama (MHA)', lambda: c('LlamaConfig', 'LlamaForCausalLM', num_hidden_layers=2, num_key_value_heads=4)
    yield 'Qwen2 (GQA)', lambda: c('Qwen2Config', 'Qwen2ForCausalLM', num_hidden_layers=2)
    yield 'Qwen3 (GQA, head_dim 32)', lambda: c('Qwen3Config', 'Qwen3ForCausalLM', num_hidden_layers=2, head_dim=32)
    yield (
        'Mistral (sliding window)',
        lambda: c('MistralConfig', 'MistralForCausalLM', num_hidden_layers=2, sliding_window=256),
    )
    yield 'Phi-3', lambda: c('Phi3Config', 'Phi3ForCausalLM', num_hidden_layers=2, pad_token_id=0)
    yield (
        'Gemma-2',
        lambda: c('Gemma2Config', 'Gemma2ForCausalLM', num_hidden_layers=4, head_dim=16, sliding_window=256),
    )
    yield (
        'Gemma-3',
        lambda: c('Gemma3TextConfig', 'Gemma3ForCausalLM', num_hidden_layers=6, head_dim=16, sliding_window=256),
    )
    yield 'Cohere2', lambda: c('Cohere2Config', 'Cohere2ForCausalLM', num_hidden_layers=4, sliding_window=256)
    yield (
        'gpt-oss',
        lambda: c(
            'GptOssConfig',
            'GptOssForCausalLM',
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=128,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    )
    yield (
        'Llama-4 (chunked)',
        lambda: c(
            'Llama4TextConfig',
            'Llama4ForCausalLM',
            num_hidden_layers=4,
            head_dim=16,
            attention_chunk_size=256,
            intermediate_size_mlp=128,
            num_local_experts=2,
            interleave_moe_layer_step=2,
        ),
    )
    yield (
        'Qwen3-MoE',
        lambda: c(
            'Qwen3MoeConfig',
            'Qwen3MoeForCausalLM',
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
    )
    yield 'OLMo-2', lambda: c('Olmo2Config', 'Olmo2ForCausalLM', num_hidden_layers=2)
    yield (
        'OLMo-3 (sliding window)',
        lambda: c('Olmo3Config', 'Olmo3ForCausalLM', num_hidden_layers=4, sliding_window=256),
    )
    yield 'GLM-4', lambda: c('Glm4Config', 'Glm4ForCausalLM', num_hidden_layers=2, head_dim=16)
    yield 'Granite', lambda: c('GraniteConfig', 'GraniteForCausalLM', num_hidden_layers=2)
    yield (
        'EXAONE-4 (sliding window)',
        lambda: c(
            'Exaone4Config', 'Exaone4ForCausalLM', num_hidden_layers=4, sliding_window=256, sliding_window_pattern=4
        ),
    )
    yield 'SmolLM3 (NoPE layers)', lambda: c('SmolLM3Config', 'SmolLM3ForCausalLM', num_hidden_layers=4, pad_token_id=0)
    yield (
        'MiniMax-M2',
        lambda: c(
            'MiniMaxM2Config',
            'MiniMaxM2ForCausalLM',
            num_hidden_layers=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    )
    yield 'Mixtral (MoE)', lambda: c('MixtralConfig', 'MixtralForCausalLM', num_hidden_layers=2, num_local_experts=4)
    yield (
        'DeepSeek-V2 (MLA)',
        lambda: c(
            'DeepseekV2Config', 'DeepseekV2ForCausalLM', num_hidden_layers=2, first_k_dense_replace=1, **mla, **moe
        ),
    )
    yield (
        'DeepSeek-V3 (MLA)',
        lambda: c(
            'DeepseekV3Config',
            'DeepseekV3ForCausalLM',
            num_hidden_layers=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            **mla,
            **moe,
        ),
    )
    yield (
        'DeepSeek-V3.2 (MLA, indexer)',
        lambda: c(
            'DeepseekV32Config',
            'DeepseekV32ForCausalLM',
            num_hidden_layers=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            index_head_dim=128,  # vLLM's indexer backend takes head sizes 32, 64 and 128
            index_n_heads=4,
            index_topk=64,
            **{**mla, 'q_lora_rank': 32},  # its indexer reads the query's latent
            **moe,
        ),
    )
    yield (
        'Qwen3-Next (Gated DeltaNet)',
        lambda: c(
            'Qwen3NextConfig',
            'Qwen3NextForCausalLM',
            num_hidden_layers=4,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    )
    yield (
        'Jamba',
        lambda: c(
            'JambaConfig',
            'JambaForCausalLM',
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=2,
            expert_layer_period=2,
            use_mamba_kernels=False,
        ),
    )
    yield (
        'Bamba',
        lambda: c(
            'BambaConfig',
            'BambaForCausalLM',
            num_hidden_layers=3,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_n_groups=2,
        ),
    )
    yield (
        'Falcon-H1',
        lambda: c(
            'FalconH1Config',
            'FalconH1ForCausalLM',
            num_hidden_layers=2,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=16,
        ),
    )
    yield (
        'Granite-4 (hybrid)',
        lambda: c(
            'GraniteMoeHybridConfig',
            'GraniteMoeHybridForCausalLM',
            num_hidden_layers=4,
            layer_types=['mamba', 'attention', 'mamba', 'attention'],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_n_groups=1,
            num_local_experts=0,
            shared_intermediate_size=128,
        ),
    )
    yield (
        'Nemotron-H',
        lambda: c(
            'NemotronHConfig',
            'NemotronHForCausalLM',
            num_hidden_layers=4,
            hybrid_override_pattern='M*M-',
            mamba_num_heads=4,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=1,
            head_dim=16,
        ),
    )
    yield (
        'Zamba2',
        lambda: c(
            'Zamba2Config',
            'Zamba2ForCausalLM',
            num_hidden_layers=4,
            mamba_d_state=16,
            mamba_headdim=16,
            n_mamba_heads=8,
            layer_types=['mamba', 'hybrid', 'mamba', 'hybrid'],
            hybrid_layer_ids=[1, 3],  # vLLM maps its shared blocks from these
        ),
    )
    yield (
        'Mamba-2',
        lambda: c(
            'Mamba2Config',
            'Mamba2ForCausalLM',
            num_hidden_layers=2,
            num_heads=8,
            head_dim=16,
            state_size=16,
            n_groups=1,
            expand=2,
            num_attention_heads=None,
            num_key_value_heads=None,
            intermediate_size=None,
        ),
    )
    yield (
        'Mamba',
        lambda: c(
            'MambaConfig',
            'MambaForCausalLM',
            num_hidden_layers=2,
            state_size=16,
            num_attention_heads=None,
            num_key_value_heads=None,
        ),
    )
    yield (
        'LFM2',
        lambda: c('Lfm2Config', 'Lfm2ForCausalLM', num_hidden_layers=3, full_attn_idxs=[1], conv_dim=64),
    )  # vLLM reads conv_dim
    yield (
        'Kimi Linear',
        lambda: c(
            'KimiLinearConfig',
            'KimiLinearForCausalLM',
            num_hidden_layers=4,
            head_dim=16,
            linear_attn_config={
                'kda_layers': [1, 3],
                'full_attn_layers': [2, 4],
                'num_heads': 4,
                'head_dim': 16,
                'short_conv_kernel_size': 4,
            },
        ),
    )
    yield (
        'MiniMax (lightning)',
        lambda: c(
            'MiniMaxConfig',
            'MiniMaxText01ForCausalLM',
            num_hidden_layers=2,
            head_dim=16,
            layer_types=['linear_attention', 'full_attention'],
            num_local_experts=2,
        ),
    )


def figures(folder: str, budget: int, mml: int) -> dict:
    "One engine's KV figures."
    from vllm import LLM

    llm = LLM(
        folder,
        load_format='dummy',
        skip_tokenizer_init=True,
        max_model_len=mml,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=budget,
        max_num_seqs=8,
    )
    try:
        cc = llm.llm_engine.vllm_config.cache_config
        out = dict(
            num_blocks=cc.num_gpu_blocks,
            block_size=cc.block_size,
            kv_cache_tokens=cc.kv_cache_size_tokens,
            max_concurrency=cc.kv_cache_max_concurrency,
            max_num_batched_tokens=llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
        )
        try:
            kcc = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
            out['groups'] = [
                dict(
                    spec=type(g.kv_cache_spec).__name__,
                    layers=len(g.layer_names),
                    block_size=g.kv_cache_spec.block_size,
                    page_bytes=g.kv_cache_spec.page_size_bytes,
                )
                for g in kcc.kv_cache_groups
            ]
        except Exception as e:  # the groups are extra detail; the figures stand without them
            out['groups_error'] = repr(e)
        return out
    finally:
        with contextlib.suppress(Exception):  # shutting down is best effort; the next engine starts anyway
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main(only=()):
    import vllm

    res = json.loads(OUT.read_text()) if OUT.exists() else {}
    res.setdefault('engine', {})['vllm'] = vllm.__version__
    import transformers

    res['engine']['transformers'] = transformers.__version__
    res['engine'].update(budgets=list(BUDGETS), max_model_lens=list(LENS), block_size=BLOCK_SIZE)
    arch = res.setdefault('architectures', {})
    for name, make in configs():
        if only and name not in only:
            continue
        entry = arch[name] = {}
        try:
            cfg = make()
        except Exception as e:
            entry['refused'] = f'config: {type(e).__name__}: {e}'
            print(name, entry['refused'], flush=True)
            continue
        entry['config'] = cfg.to_diff_dict() | {'model_type': cfg.model_type}
        entry['runs'] = []
        with tempfile.TemporaryDirectory() as d:
            cfg.save_pretrained(d)
            for budget in BUDGETS:
                for mml in LENS:
                    t = time.time()
                    try:
                        f = figures(d, budget, mml)
                    except Exception as e:
                        msg = f'{type(e).__name__}: {e}'.strip().splitlines()
                        entry['refused'] = ' '.join(msg)[:600]
                        traceback.print_exc()
                        break
                    entry['runs'].append(dict(budget_bytes=budget, max_model_len=mml, **f))
                    print(name, budget, mml, f, f'{time.time() - t:.1f}s', flush=True)
                if 'refused' in entry:
                    break
        OUT.write_text(json.dumps(res, indent=1, ensure_ascii=False) + '\n')
    OUT.write_text(json.dumps(res, indent=1, ensure_ascii=False) + '\n')


if __name__ == '__main__':
    main(set(sys.argv[1:]))
