"""Rule rewards (GSM8K per verl's published rules, arithmetic), the registry, and the RewardPool backends/time-outs."""
import json
import os
import random
import signal
import time

import pytest

from tripod.engine.rewards import (
    RewardPool,
    arithmetic,
    check_data_sources,
    get_reward_fn,
    gsm8k,
    register_reward,
    registered_data_sources,
)

GSM8K_TEST = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "..", "shared", "data",
                          "gsm8k", "test.jsonl")  # ../shared beside the checkout (CI lays a copy there)


# ------------------------------------------------------------------------------------------------ GSM8K rules
def test_every_official_gsm8k_test_answer_scores_one():
    if not os.path.isfile(GSM8K_TEST):
        pytest.skip(f"{GSM8K_TEST} not present")
    with open(GSM8K_TEST) as f:
        examples = [json.loads(line) for line in f if line.strip()]
    assert len(examples) == 1319
    with_commas = 0
    for ex in examples:
        raw = ex["answer"].rsplit("####", 1)[1].strip()  # the official final answer, e.g. "1,600"
        truth = raw.replace(",", "")
        assert gsm8k.compute_score(ex["answer"], truth) == 1.0, ex["answer"][-80:]
        assert gsm8k.compute_score(ex["answer"], truth, method="strict", score=2.5) == 2.5
        # flexible takes the last number as written, so an answer printed with a thousands comma does not match
        # its comma-free ground truth (verl's published behaviour).
        expected_flexible = 0.0 if "," in raw else 1.0
        with_commas += "," in raw
        assert gsm8k.compute_score(ex["answer"], truth, method="flexible") == expected_flexible
        wrong = str(int(float(truth)) + random.Random(truth).randint(1, 9))
        assert gsm8k.compute_score(ex["answer"], wrong) == 0.0
    assert with_commas > 0  # the comma case is really exercised


@pytest.mark.parametrize("response, truth, kwargs, expected", [
    ("so 3 + 4 = 7 apples.\n#### 72", "72", {}, 1.0),
    ("#### 71", "72", {}, 0.0),                                    # wrong number
    ("#### 71", "72", {"format_score": 0.1}, 0.1),                 # well formatted but wrong
    ("The answer is 72", "72", {}, 0.0),                           # no ####
    ("The answer is 72", "72", {"method": "flexible"}, 1.0),
    ("#### 1,234", "1234", {}, 1.0),                               # commas removed
    ("#### 1,234", "1234", {"method": "flexible"}, 0.0),           # flexible keeps commas
    ("#### $72", "72", {}, 0.0),                                   # '$' after '#### ' is not an answer (verl's regex)
    ("#### $72", "72", {"method": "flexible"}, 1.0),
    ("#### 72 dollars in total", "72", {}, 1.0),                   # trailing text
    ("#### 72.", "72", {}, 0.0),                                   # the trailing '.' is part of the match
    ("#### 5 first, then\n#### 72", "72", {}, 1.0),                # the last #### wins
    ("#### 72\n#### 5", "72", {}, 0.0),
    ("#### -3", "-3", {}, 1.0),
    ("####72", "72", {}, 0.0),                                     # a space is required
    ("#### 72" + " x" * 150, "72", {}, 0.0),                       # #### outside the last 300 characters
    ("#### 72" + " x" * 150, "72", {"method": "flexible"}, 0.0),
    ("#### 72" + " x" * 146, "72", {}, 1.0),                       # just inside them (299 chars from the '#')
    ("it is 72 . Then . and .", "72", {"method": "flexible"}, 1.0),  # bare '.' tokens are skipped
    ("it is 72.", "72", {"method": "flexible"}, 0.0),              # "72." is the last number-like token
    ("#### 72", "72", {"score": 2.0}, 2.0),
    ("", "72", {}, 0.0),
])
def test_gsm8k_rules_on_perturbed_responses(response, truth, kwargs, expected):
    assert gsm8k.compute_score(response, truth, **kwargs) == expected


def test_gsm8k_bad_method():
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 1", "1", method="fuzzy")


@pytest.mark.parametrize("response, truth, expected", [
    ("#### 12", "12", 1.0), ("#### 12.0", "12", 1.0), ("#### 1,200", "1200", 1.0), ("#### -0", "0", 1.0),
    ("#### 13", "12", 0.0), ("12", "12", 0.0), ("#### -12", "12", 0.0), ("#### 1.2.3", "12", 0.0),
])
def test_arithmetic_reward(response, truth, expected):
    assert arithmetic.compute_score(response, truth) == expected
    assert get_reward_fn("arithmetic")(response, truth) == expected


# ------------------------------------------------------------------------------------------------ registry
def test_registry_lookup_and_errors():
    assert get_reward_fn("openai/gsm8k") is gsm8k.gsm8k_reward
    assert {"openai/gsm8k", "gsm8k", "arithmetic"} <= set(registered_data_sources())
    with pytest.raises(ValueError, match=r"data_source='nope'.*registered data sources are \[.*arithmetic"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match=r"\['nope', 'nope2'\]"):
        check_data_sources(["gsm8k", "nope", "nope2"])
    with pytest.raises(ValueError, match="already has reward function"):
        register_reward("arithmetic")(lambda s, g, extra_info=None: 0.0)
    with pytest.raises(ValueError, match="unknown_source"):
        RewardPool(data_sources=["unknown_source"])


# ------------------------------------------------------------------------------------------------ pool
def _hanging_scorer(solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        while True:
            pass
    if solution_str == "sleep":
        time.sleep(60)
    return 1.0 if solution_str == ground_truth else 0.0


def _stuck_scorer(solution_str, ground_truth, extra_info=None):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # like a C extension that never returns to Python
    time.sleep(60)


def _raising_scorer(solution_str, ground_truth, extra_info=None):
    raise RuntimeError("broken scorer")


register_reward("test/hang")(_hanging_scorer)
register_reward("test/stuck")(_stuck_scorer)
register_reward("test/raise")(_raising_scorer)


def _random_batch(n, seed):
    rng = random.Random(seed)
    sols, truths, sources = [], [], []
    for _ in range(n):
        truth = str(rng.randint(-500, 5000))
        answer = truth if rng.random() < 0.5 else str(int(truth) + rng.randint(1, 30))
        template = rng.choice(["Step by step... so #### {a}", "The result is {a}", "#### {a} and more text",
                               "#### {a}" + " pad" * 80, "x = {a}"])
        sols.append(template.format(a=answer))
        truths.append(truth)
        sources.append(rng.choice(["openai/gsm8k", "arithmetic"]))
    return sols, truths, sources


def test_pool_inline_matches_direct_scoring_and_process_pool():
    sols, truths, sources = _random_batch(96, seed=1234)
    direct = [gsm8k.compute_score(s, t) if d == "openai/gsm8k" else arithmetic.compute_score(s, t)
              for s, t, d in zip(sols, truths, sources)]
    assert 10 < sum(direct) < 86  # a real mix of right and wrong
    with RewardPool(num_workers=1, timeout_s=5) as pool:
        assert pool.backend == "inline"
        inline, metrics = pool.score(sols, truths, sources)
    assert inline == direct and metrics == {"reward/num_timeouts": 0.0, "reward/num_errors": 0.0}
    with RewardPool(num_workers=2, timeout_s=5) as pool:
        assert pool.backend == "process"
        processed, metrics = pool.score(sols, truths, sources)
        again, _ = pool.score(sols[:5], truths[:5], sources[:5])  # the pool is reused
    assert processed == direct and again == direct[:5] and metrics["reward/num_timeouts"] == 0.0
    with pytest.raises(ValueError, match="same length"):
        RewardPool().score(sols, truths[:3], sources)


@pytest.mark.parametrize("backend", ["inline", "process"])
def test_hung_scorer_times_out(backend):
    sols = ["a", "hang", "b", "sleep", "#### 7"]
    truths = ["a", "x", "c", "x", "7"]
    sources = ["test/hang"] * 4 + ["arithmetic"]
    start = time.monotonic()
    with RewardPool(num_workers=2, timeout_s=0.3, backend=backend) as pool:
        scores, metrics = pool.score(sols, truths, sources)
    assert time.monotonic() - start < 10
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert metrics["reward/num_timeouts"] == 2.0 and metrics["reward/num_errors"] == 0.0


def test_stuck_worker_is_killed_and_pool_recovers():
    with RewardPool(num_workers=2, timeout_s=0.2, backend="process", hard_deadline_grace_s=0.5) as pool:
        scores, metrics = pool.score(["s", "#### 3"], ["s", "3"], ["test/stuck", "arithmetic"])
        assert scores[0] == 0.0 and metrics["reward/num_timeouts"] >= 1.0
        scores, metrics = pool.score(["#### 3", "#### 4"], ["3", "3"], ["arithmetic", "arithmetic"])
        assert scores == [1.0, 0.0] and metrics["reward/num_timeouts"] == 0.0


def test_raising_scorer_scores_zero_and_is_counted():
    with RewardPool(backend="inline") as pool:
        scores, metrics = pool.score(["x", "#### 1"], ["x", "1"], ["test/raise", "gsm8k"])
    assert scores == [0.0, 1.0] and metrics["reward/num_errors"] == 1.0


@pytest.mark.timeout(180)
def test_ray_pool_matches_inline():
    ray = pytest.importorskip("ray")
    sols, truths, sources = _random_batch(40, seed=7)
    inline, _ = RewardPool(backend="inline").score(sols, truths, sources)
    started_here = not ray.is_initialized()
    try:
        with RewardPool(num_workers=2, timeout_s=10, use_ray=True) as pool:
            assert pool.backend == "ray"
            scores, metrics = pool.score(sols, truths, sources)
    finally:
        if started_here:
            ray.shutdown()
    assert scores == inline and metrics["reward/num_timeouts"] == 0.0
