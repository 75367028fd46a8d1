"""Multi-turn rows in the PPO batch: tool tokens carry response_mask 0, and the policy loss, the KL loss and the
entropy bonus put exactly zero gradient on them before aggregation and count them in no normaliser; advantages are
zero there, the reward sits on the last model token, the packed layouts lay the whole response out. A planted mask
that covers the tool tokens fails the same checks."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.agent import ScriptedEngine, chatml_tokenizer
from tests.unit.test_agent_loop import make_loop, prompts_of
from tripod.engine.agent.loop import MODEL, TOOL
from tripod.engine.algorithms import AGG_MODES, agg_norm, compute_advantage, entropy_loss, kl_loss, policy_loss
from tripod.engine.rollout.base import SamplingParams
from tripod.engine.workers.packing import _unit_lengths
from tripod.engine.workers.row_shards import step_batch
from tripod.parallel.response_span import response_span

R = 400


def multi_turn_rollout():
    tok = chatml_tokenizer()
    prompts = prompts_of(tok, ["2+3?", "what is 4+4?"])
    rows, _ = make_loop(tok, response_length=R).run(ScriptedEngine(tok, calls_per_row=2), prompts, 2,
                                                    SamplingParams(max_new_tokens=R))
    return prompts, rows


def batch_of(prompts, rows, codes):
    batch, _ = step_batch(prompts, [0, 1], 2, [t.response for t in rows], [torch.tensor(t.log_probs) for t in rows],
                          [t.finish for t in rows], [1.0, 0.0, 1.0, 0.5], R, 0, None, codes)
    return batch


def assert_tool_tokens_carry_nothing(batch, rows):
    """The checks of the module docstring on `batch` (rows' codes say where the tool tokens are)."""
    mask = batch["response_mask"]
    tool = torch.zeros_like(mask, dtype=torch.bool)
    model = torch.zeros_like(tool)
    for i, t in enumerate(rows):
        codes = torch.tensor(t.codes)
        tool[i, : len(codes)] = codes == TOOL
        model[i, : len(codes)] = codes == MODEL
    assert tool.any() and model.any()
    assert (mask[tool] == 0).all(), "tool tokens carry response_mask 1"
    assert (mask[model] == 1).all()
    g = torch.Generator().manual_seed(0)
    shape = mask.shape
    old, ref = -torch.rand(shape, generator=g), -torch.rand(shape, generator=g)
    adv = torch.randn(shape, generator=g)
    for agg in AGG_MODES:
        norm = agg_norm(mask, agg)
        counted = float(model.sum()) if agg in ("token-mean", "token-sum") else float(len(rows))
        assert float(norm) == counted, f"{agg}: the normaliser counts {float(norm)}, the model wrote {counted}"
        logp = (-torch.rand(shape, generator=g)).requires_grad_()
        ent = torch.rand(shape, generator=g).requires_grad_()
        pg, _ = policy_loss(old, logp, adv, mask, agg=agg, global_norm=norm)
        kl = kl_loss(logp, ref, mask, "low_var_kl", agg, global_norm=norm)
        en = entropy_loss(ent, mask, agg, global_norm=norm)
        for name, loss, x in (("policy loss", pg, logp), ("KL loss", kl, logp), ("entropy", en, ent)):
            (grad,) = torch.autograd.grad(loss, x, retain_graph=True)
            assert (grad[tool] == 0).all(), f"{agg}: the {name} has gradient on tool tokens"
            assert (grad[model] != 0).any()
    # advantages (GRPO's and GAE's) and the reward's position
    index = torch.tensor([0, 0, 1, 1])
    rewards = torch.zeros(shape)
    last = response_span(mask) - 1
    rewards[torch.arange(4), last] = torch.tensor([1.0, 0.0, 1.0, 0.5])
    for i, t in enumerate(rows):
        assert t.codes[int(last[i])] == MODEL and int(last[i]) == len(t.codes) - 1
    adv, _ = compute_advantage("grpo", rewards, mask, index=index)
    assert (adv[tool] == 0).all() and (adv[model] != 0).any()
    adv, _ = compute_advantage("gae", rewards, mask, values=torch.randn(shape, generator=g), gamma=1.0, lam=0.95)
    assert (adv[tool] == 0).all()


def test_tool_tokens_are_masked_out_of_every_loss_term_and_normaliser():
    prompts, rows = multi_turn_rollout()
    batch = batch_of(prompts, rows, [torch.tensor(t.codes, dtype=torch.uint8) for t in rows])
    assert_tool_tokens_carry_nothing(batch, rows)
    # a packed layout lays out every response token up to the last model token (the mask's sum would cut it short)
    assert response_span(batch["response_mask"]).tolist() == [len(t.response) for t in rows]
    assert _unit_lengths(batch, [[i] for i in range(4)]) == [len(prompts[i // 2]) + len(t.response)
                                                             for i, t in enumerate(rows)]


def test_a_planted_mask_covering_the_tool_tokens_fails():
    prompts, rows = multi_turn_rollout()
    batch = batch_of(prompts, rows, None)  # the bug: every response token counted as the model's
    with pytest.raises(AssertionError, match="tool tokens carry response_mask 1"):
        assert_tool_tokens_carry_nothing(batch, rows)


def test_response_span_of_contiguous_masks_is_their_sum():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 0, 0.]])
    assert response_span(mask).tolist() == [3, 0, 5, 3]


def test_the_rollout_dump_writes_turns_for_single_and_multi_turn_rows(tmp_path):
    import json

    from tripod.engine.async_rollout.source import dump_rollout
    from tripod.engine.data.dataset import PromptBatch
    from tripod.engine.rollout.rows import Rollout

    tok = chatml_tokenizer()
    prompts, rows = multi_turn_rollout()
    batch = PromptBatch(input_ids=prompts, ground_truths=["5", "8"], data_sources=["x", "x"], indices=[0, 1])
    for name, codes in (("multi", [torch.tensor(t.codes, dtype=torch.uint8) for t in rows]), ("single", None)):
        rollout = Rollout(batch, [t.response for t in rows], [1.0] * 4, [1.0] * 4, [0.0] * 4, {},
                          [torch.tensor(t.log_probs) for t in rows], [t.finish for t in rows], codes)
        dump_rollout(str(tmp_path / name), 1, rollout, [[[0, 0]]] * 4, tok)
        with open(tmp_path / name / "1.jsonl") as f:
            dumped = [json.loads(line) for line in f]
        for row, t in zip(dumped, rows):
            assert row["output"] == tok.decode(t.response) and row["gts"] in ("5", "8") and row["step"] == 1
            if codes is None:  # a single-turn row: one assistant turn, all of it trained
                assert row["turns"] == [{"role": "assistant", "text": row["output"], "n_tokens": len(t.response),
                                         "trained": True}]
            else:
                assert [(d["role"], d["text"], d["n_tokens"], d["trained"]) for d in row["turns"]] == \
                    [(d["role"], d["text"], d["n_tokens"], d["trained"]) for d in t.turns]
