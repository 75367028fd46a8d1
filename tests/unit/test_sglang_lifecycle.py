"""The SGLang backend's life cycle (issue 18 item 7) against a recording stand-in of the `sglang` package.

Real SGLang needs CUDA; what can be checked on CPU is what tripod asks of it: the placement options of each engine
(base_gpu_id / gpu_id_step from the group's local ranks, disjoint port / nccl_port), slime's memory order (empty_cache,
resume weights, push, resume KV cache + CUDA graphs, ipc_collect), the torch-reduction patch before any tensor is
serialised, and the NCCL variables every rank gets before its process group starts."""
import os
import textwrap

import pytest
import torch

FAKE_SGLANG = {
    "sglang/__init__.py": """
        EVENTS = []
        PATCHED = [False]

        class Engine:
            def __init__(self, **kw): EVENTS.append(("init", kw))
            def resume_memory_occupation(self, tags=None): EVENTS.append(("resume", tuple(tags or ())))
            def release_memory_occupation(self, tags=None): EVENTS.append(("release",))
            def update_weights_from_tensor(self, named_tensors, load_format, flush_cache):
                EVENTS.append(("update", load_format, len(named_tensors)))
            def flush_cache(self): EVENTS.append(("flush",))
            def shutdown(self): EVENTS.append(("shutdown",))
            def generate(self, input_ids, sampling_params, return_logprob):
                EVENTS.append(("generate", len(input_ids)))
                return [dict(output_ids=[3, 4], meta_info=dict(output_token_logprobs=[(-0.5, 3, None), (-0.25, 4, None)],
                                                                finish_reason=dict(type="length"))) for _ in input_ids]
    """,
    "sglang/srt/__init__.py": "",
    "sglang/srt/constants.py": """
        GPU_MEMORY_TYPE_WEIGHTS = "weights"
        GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"
        GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
    """,
    "sglang/srt/utils/__init__.py": """
        import sglang

        class MultiprocessingSerializer:
            @staticmethod
            def serialize(obj, output_str=False):
                sglang.EVENTS.append(("serialize", sglang.PATCHED[0], obj["flattened_tensor"].dtype))
                return "payload"
    """,
    "sglang/srt/utils/patch_torch.py": """
        import sglang

        def monkey_patch_torch_reductions():
            sglang.PATCHED[0] = True
    """,
    "sglang/srt/weight_sync/__init__.py": "",
    "sglang/srt/weight_sync/tensor_bucket.py": """
        from dataclasses import dataclass
        from typing import Any

        @dataclass
        class FlattenedTensorMetadata:
            name: str
            shape: Any
            dtype: Any
            start_idx: int
            end_idx: int
            numel: int

        class FlattenedTensorBucket:
            def __init__(self, flattened_tensor, metadata):
                self.flat, self.meta = flattened_tensor, metadata
            def get_flattened_tensor(self): return self.flat
            def get_metadata(self): return self.meta
    """,
}


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    import sys

    for rel, text in FAKE_SGLANG.items():
        path = tmp_path / "site" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    import sglang

    from tripod.engine.rollout import sglang_engine
    monkeypatch.setattr(sglang_engine, "require_sglang", lambda: None)  # the real one also wants CUDA
    monkeypatch.setenv("LOCAL_RANK", "3")
    yield sglang
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        sys.modules.pop(name, None)


def test_engine_life_cycle_follows_slimes_memory_order(tmp_path, fake_sglang):
    from safetensors.torch import load_file

    from tests.helpers.common import make_tiny_hf_model
    from tripod.engine.rollout.base import SamplingParams
    from tripod.engine.rollout.sglang_engine import SGLANG_BASE_PORT, SGLangRolloutEngine
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, hf_to_megatron

    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=4)
    arch = arch_from_hf(hf_dir)
    disk = load_file(os.path.join(hf_dir, "model.safetensors"))
    shard = {n: family_of(arch).shard(arch, n, t, 1, 0) for n, t in hf_to_megatron(arch, disk).items()}
    engine = SGLangRolloutEngine(arch, None, model_path=hf_dir, update_bucket_bytes=16 << 10)
    init = fake_sglang.EVENTS[0][1]
    assert (init["base_gpu_id"], init["gpu_id_step"]) == (3, 1)
    assert init["port"] == SGLANG_BASE_PORT and init["nccl_port"] not in (None, init["port"])
    fake_sglang.EVENTS.clear()

    engine.release_memory()  # WeightSync's order: release, then per step resume -> load -> generate -> release
    engine.resume_memory()
    engine.load_weights(shard)
    out = engine.generate([[5, 6], [7]], SamplingParams(max_new_tokens=2, n=2))
    engine.release_memory()
    kinds = [e[0] for e in fake_sglang.EVENTS]
    assert kinds[:2] == ["release", "resume"] and fake_sglang.EVENTS[1] == ("resume", ("weights",))
    pushes = [i for i, k in enumerate(kinds) if k == "update"]
    assert len(pushes) > 1  # several buckets
    serialized = [e for e in fake_sglang.EVENTS if e[0] == "serialize"]
    assert len(serialized) == len(pushes) and all(patched for _, patched, _ in serialized)
    kv = kinds.index("resume", 2)
    assert fake_sglang.EVENTS[kv] == ("resume", ("kv_cache", "cuda_graph")) and pushes[-1] < kinds.index("flush") < kv
    assert kinds[kv + 1:] == ["generate", "release"]
    assert out.response_ids.shape == (4, 2) and torch.equal(out.log_probs[0], torch.tensor([-0.5, -0.25]))


def test_engine_placement_follows_strided_groups_and_separates_ports():
    from tripod.engine.rollout.sglang_engine import engine_placement

    a = engine_placement([("n0", 0), ("n0", 2)], 0)
    b = engine_placement([("n0", 1), ("n0", 3)], 1)
    assert (a["base_gpu_id"], a["gpu_id_step"], b["base_gpu_id"], b["gpu_id_step"]) == (0, 2, 1, 2)
    assert len({a["port"], a["nccl_port"], b["port"], b["nccl_port"]}) == 4
    with pytest.raises(ValueError, match="not evenly strided"):
        engine_placement([("n0", 0), ("n0", 1), ("n0", 3)], 0)
    with pytest.raises(ValueError, match="spans hosts"):
        engine_placement([("n0", 0), ("n1", 0)], 0)


def test_every_rank_gets_sglangs_nccl_variables():
    from tripod.engine.rollout.sglang_engine import sglang_process_env

    assert sglang_process_env({}) == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    assert sglang_process_env({"enable_symm_mem": True}) == {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "1"}
