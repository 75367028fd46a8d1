"""SGLang's routed experts (R3) in tripod's layout, on a synthetic SGLang-shaped result (read from SGLang's source:
python/sglang/srt/layers/moe/routed_experts_capturer.py, RoutedExpertsCapturer.get_routed_experts and the
detokenizer's base64 of the int32 bytes): meta_info["routed_experts"] holds [prompt + output - 1 tokens,
num_hidden_layers, num_experts_per_tok] in SGLang's top-k order, a dense layer's column never written. tripod's row
is [prompt + response tokens, MoE layers, k], ascending ids, the last token marked unrecorded (num_experts)."""
import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tripod.engine.rollout.routing_record import from_sglang
from tripod.engine.rollout.sglang_engine import output_from_sglang

MOE = SimpleNamespace(num_experts=8, topk=2, layer_is_moe=(True, True, False, True))  # layer 2 dense


def _sglang_result(prompt: list[int], output: list[int], g: torch.Generator) -> tuple[dict, torch.Tensor]:
    """(SGLang's result dict for one request, the MoE layers' expert ids per token it encodes, [T-1, 3, 2])."""
    tokens = len(prompt) + len(output) - 1
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens * 4)]).view(tokens, 4, 2)
    ids[:, 2] = 0  # the dense layer: SGLang's zero-initialised buffer, never captured
    raw = base64.b64encode(ids.to(torch.int32).numpy().tobytes()).decode()
    meta = {"output_token_logprobs": [(-0.5, t, None) for t in output], "finish_reason": {"type": "length"},
            "routed_experts": raw}
    return {"output_ids": output, "meta_info": meta}, ids[:, [0, 1, 3]]


def test_sglang_output_becomes_tripods_record():
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7], [9, 10]]
    outputs = [[11, 12], [13, 14, 15], [16], [17, 18, 19, 20]]  # n = 2 samples per prompt, prompt-major
    requests = [prompts[0], prompts[0], prompts[1], prompts[1]]
    made = [_sglang_result(p, o, g) for p, o in zip(requests, outputs)]
    arch = SimpleNamespace(moe=MOE)
    out = output_from_sglang([r for r, _ in made], 2, 2, 0, requests, arch)
    assert len(out.routed_experts) == 4
    for row, (p, o, (_, want)) in enumerate(zip(requests, outputs, made)):
        got = out.routed_experts[row]
        assert got.shape == (len(p) + len(o), 3, 2) and got.dtype == torch.uint8
        assert torch.equal(got[:-1].long(), want.sort(-1).values.long())  # every token but the last, MoE layers only
        assert bool((got[-1] == MOE.num_experts).all())  # the last token never went back through the model
    assert output_from_sglang([r for r, _ in made], 2, 2, 0).routed_experts is None  # not asked for


def test_decoded_arrays_and_wrong_sizes():
    g = torch.Generator().manual_seed(1)
    res, want = _sglang_result([1, 2], [3, 4], g)
    decoded = np.frombuffer(base64.b64decode(res["meta_info"]["routed_experts"]), dtype=np.int32).reshape(3, 4, 2)
    assert torch.equal(from_sglang(decoded, 4, MOE)[:-1].long(), want.sort(-1).values.long())
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        from_sglang(res["meta_info"]["routed_experts"], 5, MOE)  # a token more than SGLang recorded
