"""Rollout engines (engine/rollout/): the embedded TP decoder against `transformers`, sampling,
stopping, memory release, errors; the SGLang backend on a GPU when one (and sglang) is present.

TP=1 checks run in this process; TP=2 runs one torchrun launch (tests/multiprocess/workers/tp2_rollout_check.py).
References are HF `generate` / HF forward (tests/multiprocess/workers/hf_rollout_reference.py) and HF's own
logits warpers for the sampling distribution.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from tests.helpers.common import run_torchrun
from tests.multiprocess.workers import hf_rollout_reference as ref
from tripod.engine.rollout import SamplingParams, make_rollout_engine, validate_rollout_tp  # noqa: E402
from tripod.engine.rollout.sampling import sample_next_token  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("rollout_models"))
    return {v: ref.tiny_checkpoint(tmp, v) for v in [*ref.VARIANTS, *ref.TP1_ONLY_VARIANTS]}


@pytest.fixture(scope="module")
def llama(checkpoints):
    """(arch, HF model, TP=1 embedded engine with weights loaded) for the Llama variant."""
    arch, model, state = ref.load_hf(checkpoints["llama_rope_llama3"])
    engine = make_rollout_engine("embedded", arch, None)
    engine.load_weights(ref.generation_shard(arch, state, 1, 0))
    return arch, model, engine


@pytest.mark.parametrize("variant", ["qwen2_bias_tied", "llama_rope_llama3", "qwen2_rope_yarn", "qwen3_qknorm_tied"])
def test_greedy_equals_hf_generate_tp1(checkpoints, variant):
    arch, model, state = ref.load_hf(checkpoints[variant])
    if variant == "qwen2_rope_yarn":
        assert arch.rope_inv_freq()[1] > 1.05  # the test really exercises attention_scaling
    engine = make_rollout_engine("embedded", arch, None)
    engine.load_weights(ref.generation_shard(arch, state, 1, 0))
    prompts = ref.random_prompts(arch.vocab_size, [5, 11, 1, 8], seed=3)
    assert ref.check_against_hf(engine, model, prompts, max_new_tokens=12) == 4 * 12


@pytest.mark.dist
def test_tp2_greedy_sampling_and_stops_in_one_launch(tmp_path):
    proc = run_torchrun("tp2_rollout_check.py", 2, tmp_path, timeout=240)
    for variant in ref.VARIANTS:
        line = next((l for l in proc.stdout.splitlines() if l.startswith(f"ROLLOUT_TP2_OK {variant} ")), None)
        assert line is not None, proc.stdout[-3000:]
        assert int(line.split()[-1]) == 3 * 10


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, -1, 0.8), (1.5, 3, 1.0), (1.0, 4, 0.6)])
def test_sampling_distribution_matches_hf_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(1, 7, generator=torch.Generator().manual_seed(int(temperature * 10 + top_k)))
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        expected = TopKLogitsWarper(top_k)(None, expected)
    expected = torch.softmax(TopPLogitsWarper(top_p)(None, expected), -1)[0]

    draws = 20000
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logp = sample_next_token(logits.expand(draws, -1), params, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=7).float() / draws
    assert (freq - expected).abs().max() < 0.02, (freq, expected)  # ~6 sigma at 20k draws
    assert torch.all(freq[expected == 0] == 0), "sampled a token outside top-k / top-p"
    # reported log-prob: log_softmax(logits / T) before truncation (engine/rollout/base.py)
    assert torch.allclose(logp, torch.log_softmax(logits[0] / temperature, -1)[tokens], atol=1e-6)


def test_seed_n_samples_and_top_k_one(llama):
    arch, _, engine = llama
    prompts = ref.random_prompts(arch.vocab_size, [4, 7], seed=5)
    params = SamplingParams(max_new_tokens=6, temperature=1.5, n=4, seed=99)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)
    assert a.prompt_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and len(a) == 8
    assert len({tuple(r) for r in a.responses()[:4]}) > 1, "n=4 samples of one prompt are all identical"
    other_seed = engine.generate(prompts, dataclasses.replace(params, seed=100))
    assert not torch.equal(a.response_ids, other_seed.response_ids)

    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8, top_k=1, n=2, seed=1))
    assert top1.responses() == [r for r in greedy.responses() for _ in range(2)]
    zero_temp = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert torch.equal(zero_temp.response_ids, greedy.response_ids)


def test_n_samples_share_one_prefill(llama):
    """n samples of a prompt (one prefill, cache rows copied) == the prompt listed n times (n prefills): same tokens,
    log-probs within fp32 rounding. Two prompts of different lengths, so a wrong row copy would mix them."""
    arch, _, engine = llama
    prompts = ref.random_prompts(arch.vocab_size, [3, 8], seed=11)
    params = SamplingParams(max_new_tokens=7, temperature=1.2, n=3, seed=5)
    shared = engine.generate(prompts, params)
    listed = engine.generate([p for p in prompts for _ in range(3)], dataclasses.replace(params, n=1))
    assert torch.equal(shared.response_ids, listed.response_ids)
    assert torch.allclose(shared.log_probs, listed.log_probs, atol=1e-5)


def test_eos_stop_and_max_new_tokens(llama):
    arch, model, engine = llama
    prompts = ref.random_prompts(arch.vocab_size, [3, 9, 6], seed=8)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=9, greedy=True))
    assert free.response_ids.shape == (3, 9) and free.response_lengths.tolist() == [9, 9, 9]
    assert free.finish_reasons == ["length"] * 3

    # Make a token the first row emits at step 4 the model's EOS: the engine must end each row at its
    # first EOS, like HF generate with that eos_token_id, and ignore_eos must switch that off.
    eos = free.responses()[0][4]
    engine.arch = dataclasses.replace(arch, eos_token_id=eos)
    try:
        stopped = engine.generate(prompts, SamplingParams(max_new_tokens=9, greedy=True))
        ignored = engine.generate(prompts, SamplingParams(max_new_tokens=9, greedy=True, ignore_eos=True))
    finally:
        engine.arch = arch
    hf = ref.hf_greedy(model, prompts, 9, eos_id=eos)
    for row, full in enumerate(free.responses()):
        want = full[: full.index(eos) + 1] if eos in full else full
        assert stopped.responses()[row] == want
        assert stopped.finish_reasons[row] == ("stop" if eos in full else "length")
        assert torch.all(stopped.response_ids[row, len(want):] == engine.pad_token_id)
        assert torch.all(stopped.log_probs[row, len(want):] == 0)
        assert want == hf[row]
    assert stopped.response_lengths[0] == free.responses()[0].index(eos) + 1 <= 5
    assert torch.equal(ignored.response_ids, free.response_ids)


def test_generation_config_end_of_turn_id_stops_like_hf_generate(llama, checkpoints, tmp_path):
    """A chat model lists its end-of-turn id in generation_config.json and only its EOS in config.json: the engine
    stops at either, as HF `generate` (which reads generation_config.json) does; ignore_eos switches both off. The
    planted reading of config.json only (what tripod did before) runs past the end of turn and differs from HF."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from tripod.parallel.arch import arch_from_hf

    arch, _, engine = llama
    prompts = ref.random_prompts(arch.vocab_size, [3, 9, 6], seed=8)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=9, greedy=True))
    end_of_turn = free.responses()[0][3]
    assert end_of_turn != ref.EOS_ID and ref.EOS_ID not in sum(free.responses(), [])
    chat_dir = shutil.copytree(checkpoints["llama_rope_llama3"], tmp_path / "chat")
    with open(chat_dir / "generation_config.json") as f:  # save_pretrained wrote it with config.json's ids
        gen = json.load(f)
    gen["eos_token_id"] = [ref.EOS_ID, end_of_turn]
    with open(chat_dir / "generation_config.json", "w") as f:
        json.dump(gen, f)
    chat = arch_from_hf(chat_dir)
    assert chat.eos_token_id == ref.EOS_ID and chat.eos_token_ids == tuple(sorted({ref.EOS_ID, end_of_turn}))
    assert chat == arch  # the stop ids are not architecture: a checkpoint written without the file still matches

    params = SamplingParams(max_new_tokens=9, greedy=True)
    try:
        engine.arch = chat
        stopped = engine.generate(prompts, params)
        ignored = engine.generate(prompts, dataclasses.replace(params, ignore_eos=True))
        engine.arch = dataclasses.replace(chat, generation_eos_token_ids=())  # planted: config.json's EOS only
        planted = engine.generate(prompts, params)
    finally:
        engine.arch = arch
    hf = ref.hf_greedy(AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32).eval(), prompts, 9,
                       eos_id=None)
    assert stopped.responses() == hf, (stopped.responses(), hf)
    first = free.responses()[0].index(end_of_turn)
    assert stopped.responses()[0] == free.responses()[0][: first + 1] and stopped.finish_reasons[0] == "stop"
    assert torch.equal(ignored.response_ids, free.response_ids)
    assert planted.responses() == free.responses() != hf, "the planted config.json-only reading stopped anyway"


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """(tokenizer, TP=1 embedded engine) of a tiny Qwen2 whose vocabulary is the character tokenizer's (99 ids)."""
    from tests.helpers.common import make_tiny_hf_model
    from tripod.engine.data.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("char_model"), "qwen2", seed=5, num_hidden_layers=1,
                                   vocab_size=len(tok))
    arch, _, state = ref.load_hf(model_dir)
    engine = make_rollout_engine("embedded", arch, None, tokenizer=tok)
    engine.load_weights(ref.generation_shard(arch, state, 1, 0))
    return tok, engine


def _response_text(tok, prompt: list[int], response: list[int]) -> str:
    """The response's text as the engines decode it: after the prompt's, special tokens skipped."""
    skip = dict(skip_special_tokens=True)
    return tok.decode(prompt + response, **skip)[len(tok.decode(prompt, **skip)):]


def _text_stop_cut(tok, prompt: list[int], response: list[int], stops: list[str]) -> int:
    """Reference by full re-decode: the length of the shortest prefix of `response` whose text contains a stop string;
    len(response) if none does."""
    for k in range(1, len(response) + 1):
        if any(s in _response_text(tok, prompt, response[:k]) for s in stops):
            return k
    return len(response)


def test_stop_strings_end_the_response_at_the_completing_token(char_model):
    """A stop string spanning two tokens ends the response at the second one (kept, like an EOS), wherever the decoded
    text first contains it (a full re-decode is the reference): greedy rows are their free run cut there, sampled
    rows (n=2) each end at their own first match; without a tokenizer the engine refuses stop strings."""
    tok, engine = char_model
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("Hello", "2+2=", "abc", "The answer is")]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True))
    row0 = free.responses()[0]
    assert min(row0[2:4]) >= 3, row0  # two printable characters: the stop string spans two tokens
    stops = [tok.decode(row0[2:4]), tok.decode(free.responses()[3][1:3]), "never seen"]
    params = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True, stop=stops)
    out = engine.generate(prompts, params)
    cuts = [_text_stop_cut(tok, p, r, stops) for p, r in zip(prompts, free.responses())]
    assert cuts[0] <= 4 and cuts[3] <= 3 and sum(k < 12 for k in cuts) >= 3, cuts  # the test has stops to check
    assert out.responses() == [r[:k] for r, k in zip(free.responses(), cuts)], (out.responses(), cuts)
    assert out.finish_reasons == ["stop" if any(s in _response_text(tok, p, r) for s in stops) else "length"
                                  for p, r in zip(prompts, out.responses())]

    one = [tok.decode(row0[2:3])]
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=4,
                                                      ignore_eos=True, stop=one))
    for row, response in enumerate(sampled.responses()):
        prompt = prompts[int(sampled.prompt_index[row])]
        assert _text_stop_cut(tok, prompt, response, one) == len(response), (row, response)
        hit = one[0] in _response_text(tok, prompt, response)
        assert sampled.finish_reasons[row] == ("stop" if hit else "length") and (hit or len(response) == 12)

    bare = make_rollout_engine("embedded", engine.arch, None)
    bare.load_weights(engine.decoder.weights)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.stop.*tokenizer"):
        bare.generate(prompts, params)


def test_training_rollouts_stop_at_every_configured_id(tmp_path):
    """`tripod train` with the stop ids spread over their three sources, config.json's EOS (2), generation_config.json's
    `eos_token_id` list (3 .. V-1) and actor_rollout_ref.rollout.stop_token_ids ([0, 1]), ends every response after
    one token (response_length/mean 1, training and validation), and names the ids once at start; a stop string makes
    the engine load the tokenizer (data.tokenizer, else the model directory). Reading config.json's EOS only (the
    planted bug) gives longer responses."""
    import json
    import os

    from transformers import AutoTokenizer

    from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
    from tests.helpers.trainer_runs import metrics, train

    setup = make_ppo_setup(tmp_path)
    with open(os.path.join(setup["model"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    with open(os.path.join(setup["model"], "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": list(range(3, vocab))}, f)
    run_dir = str(tmp_path / "run")
    proc = train(tiny_overrides(setup, run_dir, steps=1) + [
        "actor_rollout_ref.rollout.stop_token_ids=[0,1]", "actor_rollout_ref.rollout.stop=['never said']",
        "trainer.val_before_train=false", "trainer.log_val_generations=4"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert [r["response_length/mean"] for r in metrics(run_dir) if "response_length/mean" in r] == [1.0]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rollout stops at token ids ")]
    assert lines == [f"rollout stops at token ids {list(range(vocab))} (config.json eos_token_id: 2; "
                     f"generation_config.json eos_token_id: {list(range(3, vocab))}; "
                     "actor_rollout_ref.rollout.stop_token_ids: [0, 1]) and at stop strings ['never said']"], lines
    tok = AutoTokenizer.from_pretrained(setup["model"])
    with open(os.path.join(run_dir, "val_generations.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 4 and all(len(tok.encode(x["response"], add_special_tokens=False)) <= 1 for x in samples), \
        samples


def test_release_and_resume_memory(llama):
    arch, _, engine = llama
    prompts = ref.random_prompts(arch.vocab_size, [5, 3], seed=9)
    params = SamplingParams(max_new_tokens=5, greedy=True)
    before = engine.generate(prompts, params)
    weight_bytes = engine.memory_bytes()
    assert weight_bytes > 0 and engine.kv_cache is None  # the KV cache lives only inside generate()

    saved = {n: t.clone() for n, t in engine.decoder.weights.items()}
    engine.release_memory()
    assert engine.memory_bytes() == 0 and engine.decoder.weights == {}
    with pytest.raises(RuntimeError, match="load_weights"):
        engine.generate(prompts, params)
    engine.resume_memory()
    assert engine.memory_bytes() == 0  # reserved lazily: a caller handing over ready tensors never pays for them
    assert set(engine.weight_buffers()) == set(saved) and engine.memory_bytes() == weight_bytes
    with pytest.raises(RuntimeError, match="load_weights"):
        engine.generate(prompts, params)  # buffers are back but hold no weights yet
    engine.load_weights(saved)
    assert torch.equal(engine.generate(prompts, params).response_ids, before.response_ids)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_bf16_weights_follow_fp32(llama, checkpoints, device):
    arch, _, fp32_engine = llama
    _, _, state = ref.load_hf(checkpoints["llama_rope_llama3"])
    engine = make_rollout_engine("embedded", arch, None, dtype=torch.bfloat16, device=device)
    engine.load_weights(ref.generation_shard(arch, state, 1, 0))
    assert all(t.dtype == torch.bfloat16 for t in engine.decoder.weights.values())
    prompts = ref.random_prompts(arch.vocab_size, [5, 9, 2, 7], seed=1)
    params = SamplingParams(max_new_tokens=8, greedy=True)
    ours, want = engine.generate(prompts, params), fp32_engine.generate(prompts, params)
    # this checkpoint's greedy path has clear margins, so bf16 must pick the same tokens
    assert torch.equal(ours.response_ids, want.response_ids)
    assert (ours.log_probs - want.log_probs).abs().max() < 5e-2
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, n=2, seed=3))
    assert sampled.response_ids.shape[0] == 8 and torch.isfinite(sampled.log_probs).all()


def test_errors_name_the_setting_and_the_fix(llama, checkpoints):
    arch, _, engine = llama
    with pytest.raises(ValueError, match=r"rollout\.name='trtllm'.*embedded"):
        make_rollout_engine("trtllm", arch, None)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ValueError, match=r"rollout\.name=vllm but the `vllm` package is not installed.*embedded"):
            make_rollout_engine("vllm", arch, None, model_path=checkpoints["llama_rope_llama3"])
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ImportError, match=r"rollout\.name.*pip install"):
            make_rollout_engine("sglang", arch, None, model_path=checkpoints["llama_rope_llama3"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.tensor_model_parallel_size=3"):
        validate_rollout_tp(arch, 3)
    validate_rollout_tp(arch, 2)

    _, _, state = ref.load_hf(checkpoints["llama_rope_llama3"])
    with pytest.raises(ValueError, match="resharded to rollout TP=1"):
        engine.load_weights(ref.generation_shard(arch, state, 2, 0))
    shard = ref.generation_shard(arch, state, 1, 0)
    shard.pop("decoder.layers.1.mlp.linear_fc2.weight")
    with pytest.raises(KeyError, match="linear_fc2"):
        engine.load_weights(shard)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[1, arch.vocab_size]], SamplingParams(max_new_tokens=2))


def test_sglang_request_and_result_format(llama):
    """The pure parts of the SGLang backend (runs without sglang): request dicts and result packing."""
    from tripod.engine.rollout.sglang_engine import output_from_sglang, sglang_sampling_params

    arch, _, _ = llama
    req = sglang_sampling_params(SamplingParams(max_new_tokens=5, temperature=0.7, n=2, seed=10,
                                                stop_token_ids=[7]), arch, row=3)
    assert req == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 1.0, "top_k": -1,
                   "stop_token_ids": sorted({7, arch.eos_token_id}), "ignore_eos": False, "sampling_seed": 13}
    assert sglang_sampling_params(SamplingParams(max_new_tokens=5, greedy=True), arch, 0)["temperature"] == 0.0
    results = [{"output_ids": [5, 6, 2], "meta_info": {"output_token_logprobs": [(-0.5, 5, None), (-1.0, 6, None),
                                                                                  (-0.1, 2, None)],
                                                       "finish_reason": {"type": "stop", "matched": 2}}},
               {"output_ids": [9], "meta_info": {"output_token_logprobs": [(-2.0, 9, None)],
                                                 "finish_reason": {"type": "length", "length": 1}}}]
    out = output_from_sglang(results, num_prompts=1, n=2, pad_token_id=0)
    assert out.responses() == [[5, 6, 2], [9]] and out.finish_reasons == ["stop", "length"]
    assert out.prompt_index.tolist() == [0, 0] and out.response_ids[1].tolist() == [9, 0, 0]
    assert torch.allclose(out.log_probs, torch.tensor([[-0.5, -1.0, -0.1], [-2.0, 0.0, 0.0]]))
    results[1]["meta_info"]["finish_reason"] = {"type": "abort", "message": "oom"}
    with pytest.raises(RuntimeError, match="abort"):
        output_from_sglang(results, num_prompts=1, n=2, pad_token_id=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
                    reason="the SGLang backend needs CUDA and `pip install sglang` (see docs/rollout.md)")
def test_sglang_greedy_equals_hf_and_embedded(checkpoints):
    arch, model, state = ref.load_hf(checkpoints["qwen2_bias_tied"])
    engine = make_rollout_engine("sglang", arch, None, model_path=checkpoints["qwen2_bias_tied"],
                                 mem_fraction_static=0.3)
    try:
        # perturb the weights so the update path (not the checkpoint on disk) decides the output
        state = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}
        model.load_state_dict(state, strict=False)
        engine.load_weights(ref.generation_shard(arch, state, 1, 0))
        prompts = ref.random_prompts(arch.vocab_size, [5, 11, 2], seed=3)
        out = engine.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True))
        assert out.responses() == ref.hf_greedy(model, prompts, 8)
        for row, (p, r) in enumerate(zip(prompts, out.responses())):
            assert torch.allclose(out.log_probs[row, : len(r)], ref.hf_response_logprobs(model, p, r), atol=2e-2)
        engine.release_memory()
        engine.resume_memory()
        engine.load_weights(ref.generation_shard(arch, state, 1, 0))
        assert engine.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True)).responses() == out.responses()
    finally:
        engine.shutdown()
