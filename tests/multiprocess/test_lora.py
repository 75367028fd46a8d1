"""LoRA on megatron (parallel/lora/): logits and adapter gradients equal peft's on the HF model at TP1, TP2, TP2 with
sequence parallelism, PP2 and TP2xPP2 (fp32); the merged weights the rollout gets equal W + scale * B @ A in float64
within fp32 rounding; the adapters switched off give the base model's logits bit for bit; each check fails on a
planted bug (tests/multiprocess/workers/lora_parity_worker.py)."""
import re

import pytest
import torch

from tests.helpers.bounds import worst
from tests.helpers.common import make_tiny_hf_model, run_torchrun

FLOAT = r"(-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf)"
LAYOUTS = {"TP1PP1", "TP2PP1", "TP2PP1SP", "TP1PP2", "TP2PP2"}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def peft_case(tmp_path, family: str, rank: int = 4, alpha: float = 8.0, targets: list[str] = HF_TARGETS,
              **overrides) -> dict:
    """A tiny HF model with peft adapters of random non-zero A and B on `targets`: its logits, and the adapters'
    gradients of sum(logits * weight) for a fixed random weight. `family`: qwen2, qwen3_moe or deepseek_v3 (MLA);
    `overrides` change the MoE models' HF config."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    if family in ("deepseek_v3", "qwen3_moe"):
        from tests.helpers.moe_models import make_tiny_moe_model
        hf_dir = make_tiny_moe_model(tmp_path, family, seed=3, subdir=f"{family}_{len(overrides)}", **overrides)
    else:
        hf_dir = make_tiny_hf_model(tmp_path, family, seed=3)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g)
    logits = model(input_ids).logits
    weight = torch.randn(logits.shape, generator=g)
    (logits * weight).sum().backward()
    grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad.clone()
             for n, p in model.named_parameters() if "lora_" in n}
    return {"hf_dir": hf_dir, "input_ids": input_ids, "ref_logits": logits.detach(), "weight": weight,
            "adapters": get_peft_model_state_dict(model), "grads": grads, "rank": rank, "alpha": alpha,
            "targets": ["all-linear"] if targets == HF_TARGETS else targets, "name": family}


@pytest.mark.dist
def test_lora_matches_peft_at_every_layout(tmp_path):
    """A dense Qwen2 (fused QKV with bias, fused gate/up) with adapters on every linear; a Qwen3-MoE's attention (MoE
    at TP2 runs sequence parallel); a DeepSeek-V3's MLA projections (q_a/q_b/kv_a/kv_b/o_proj; MoE, so sequence
    parallel at TP2), and the same MLA with every layer dense at TP2 without sequence parallelism. MLA at TP2 fails
    with its adapter's hook after cpu_compat's RoPE-key gradient fix, or without that fix's all-reduce over TP."""
    mla = peft_case(tmp_path, "deepseek_v3", targets=MLA_TARGETS)
    mla_dense = {**peft_case(tmp_path, "deepseek_v3", targets=MLA_TARGETS, first_k_dense_replace=4),
                 "name": "deepseek_v3_dense", "layouts": ["TP2PP1"], "no_sequence_parallel": True}
    dense = peft_case(tmp_path, "qwen2")
    dense["export_dir"] = str(tmp_path / "peft_export")  # written at TP2 x PP2, loaded back by peft below
    cases = [dense, peft_case(tmp_path, "qwen3_moe", targets=HF_TARGETS[:4]), mla, mla_dense]
    torch.save(cases, tmp_path / "cases.pt")
    out = run_torchrun("lora_parity_worker.py", 4, tmp_path / "cases.pt", timeout=400).stdout
    expected = {(m, lay) for m in ("qwen2", "qwen3_moe", "deepseek_v3") for lay in LAYOUTS} | \
        {("deepseek_v3_dense", "TP2PP1")}
    logits = {(m, lay): x for m, lay, x in re.findall(rf"LORA_LOGITS (\S+) (\S+) maxdiff {FLOAT}", out)}
    off = {(m, lay): x for m, lay, x in re.findall(rf"LORA_OFF (\S+) (\S+) maxdiff {FLOAT}", out)}
    grads = re.findall(rf"LORA_GRAD (\S+) (\S+) maxrel {FLOAT}", out)
    merge = re.findall(rf"LORA_MERGE (\S+) (\S+) err/bound {FLOAT}", out)
    planted = dict(re.findall(rf"PLANTED (\S+) maxdiff {FLOAT}", out))
    assert set(logits) == set(off) == {(m, lay) for m, lay, _ in grads} == {(m, lay) for m, lay, _ in merge} \
        == expected, out[-3000:]
    print(f"LoRA vs peft: worst |logits diff| {worst(logits.values()):.3e}, worst relative grad error "
          f"{worst(x for *_, x in grads):.3e}, merged weights vs float64 err/bound {worst(x for *_, x in merge):.3e}; "
          f"planted {planted}")
    assert worst(logits.values()) < 1e-5
    assert worst(x for *_, x in grads) < 1e-5
    assert worst(x for *_, x in merge) <= 1.0
    ckpt = re.findall(r"LORA_CKPT (\S+) (\S+) entries (\d+)", out)  # adapters TP-sharded in dist checkpoints
    assert {(m, lay) for m, lay, _ in ckpt} == {(m, lay) for m, lay in expected if lay.startswith("TP2")}, out[-3000:]
    assert all(int(n) > 0 for *_, n in ckpt)
    assert worst(off.values()) == 0.0  # adapters off: the base model, bit for bit
    assert set(planted) == {"b_other_rank", "scale_alpha", "row_unreduced"}, out[-3000:]
    assert all(float(v) > 1e-3 for v in planted.values()), planted
    planted_merge = re.findall(rf"PLANTED_MERGE scale_alpha err/bound {FLOAT}", out)
    assert len(planted_merge) == 2 and all(float(v) > 1.0 for v in planted_merge), out[-3000:]
    planted_grad = re.findall(rf"PLANTED_GRAD a_unreduced maxrel {FLOAT}", out)
    assert len(planted_grad) == 2 and all(float(v) > 1e-2 for v in planted_grad), out[-3000:]
    planted_mla = re.findall(rf"PLANTED_GRAD (mla_hook_after_tag|mla_rope_unreduced) maxrel {FLOAT}", out)
    print(f"MLA at TP2, planted: {planted_mla}")
    assert sorted(b for b, _ in planted_mla) == ["mla_hook_after_tag"] * 2 + ["mla_rope_unreduced"] * 2, out[-3000:]
    assert all(float(v) > 1e-2 for _, v in planted_mla), planted_mla
    _check_peft_export(dense)


def _check_peft_export(case: dict) -> None:
    """The adapter directory tripod wrote at TP2 x PP2 holds peft's tensors bit for bit, and peft loads it onto the
    HF model: the same logits as the peft model the adapters came from."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(f"{case['export_dir']}/adapter_model.safetensors")
    assert saved.keys() == case["adapters"].keys()
    assert all(torch.equal(saved[k], case["adapters"][k]) for k in saved)
    base = AutoModelForCausalLM.from_pretrained(case["hf_dir"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, case["export_dir"]).eval()
    with torch.no_grad():
        diff = (model(case["input_ids"]).logits - case["ref_logits"]).abs().max().item()
    print(f"peft export (TP2 x PP2) loaded by peft: |logits diff| {diff:.3e}")
    assert diff == 0.0


@pytest.mark.dist
def test_lora_trains_only_adapters_and_gives_the_reference_for_free(tmp_path):
    """Inside tripod's workers (DP2, distributed optimizer): only adapters (and the critic's value head) have grad
    buffers and optimizer state; a step moves them and leaves every base tensor bit-identical; the actor with its
    adapters off gives a no-LoRA reference's log-probs bit for bit (tests/multiprocess/workers/lora_update_worker.py)."""
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=4)
    out = run_torchrun("lora_update_worker.py", 2, hf_dir, timeout=300).stdout
    for line in ("LORA_BUFFERS actor", "LORA_BUFFERS critic", "LORA_STEP base_unchanged", "LORA_REFERENCE"):
        assert line in out, out[-3000:]
    print("\n".join(re.findall(r"LORA_BUFFERS .*", out)))  # parameters with a grad buffer (trained) and without
    off, on = map(float, re.search(rf"LORA_REFERENCE off_vs_base {FLOAT} on_vs_base {FLOAT}", out).groups())
    print(f"reference from the actor with adapters off: |diff| to the base model {off:.3e} (adapters on: {on:.3e})")
    assert off == 0.0 and on > 1e-4


def _merged_moe_case(tmp_path, rank: int = 4, alpha: float = 8.0) -> dict:
    """A tiny Qwen3-MoE (4 experts, layer 2 dense), random adapters on every expert's and the dense MLP's
    gate/up/down, and the reference: the HF model with W + scale * B @ A merged in float64 (transformers 5 keeps the
    experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]); the adapters' gradients of the mean of both DP
    ranks' losses follow from the merged weights' gradients (dA = scale B^T dW, dB = scale dW A^T)."""
    from tests.helpers.moe_models import hf_moe_model

    model = hf_moe_model("qwen3_moe", seed=2)
    hf_dir = str(tmp_path / "qwen3_moe")
    model.save_pretrained(hf_dir, safe_serialization=True)
    cfg, scale, g = model.config, alpha / rank, torch.Generator().manual_seed(11)
    h, i_moe, i_dense = cfg.hidden_size, cfg.moe_intermediate_size, cfg.intermediate_size
    adapters, weights = {}, {}  # peft name -> tensor; HF module -> (the merged parameter, its rows)
    for layer in range(cfg.num_hidden_layers):
        mlp = model.model.layers[layer].mlp
        dense = layer in cfg.mlp_only_layers
        for e in [None] if dense else range(cfg.num_experts):
            inter = i_dense if dense else i_moe
            for part, (rows, cols) in {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}.items():
                module = f"model.layers.{layer}.mlp.{part}" if dense else f"model.layers.{layer}.mlp.experts.{e}.{part}"
                a, b = torch.randn(rank, cols, generator=g) * 0.1, torch.randn(rows, rank, generator=g) * 0.1
                adapters[f"base_model.model.{module}.lora_A.weight"] = a
                adapters[f"base_model.model.{module}.lora_B.weight"] = b
                if dense:
                    param, index = getattr(mlp, part).weight, (slice(None),)
                elif part == "down_proj":
                    param, index = mlp.experts.down_proj, (e,)
                else:
                    param, index = mlp.experts.gate_up_proj, (e, slice(0, inter) if part == "gate_proj" else
                                                             slice(inter, 2 * inter))
                weights[module] = (param, index, a, b)
                with torch.no_grad():
                    param[index] = (param[index].double() + scale * b.double() @ a.double()).float()
    input_ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    logits0, logits1 = model(input_ids).logits, model(input_ids.flip(0)).logits
    weight = torch.randn(logits0.shape, generator=g)
    ((logits0 * weight).sum() + (logits1 * weight.flip(0)).sum()).div(2).backward()
    grads = {}
    for module, (param, index, a, b) in weights.items():
        dw = param.grad[index].double()
        grads[f"{module}.lora_A.weight"] = scale * b.double().t() @ dw
        grads[f"{module}.lora_B.weight"] = scale * dw @ a.double().t()
    return {"hf_dir": hf_dir, "input_ids": input_ids, "ref_logits": [logits0.detach(), logits1.detach()],
            "weight": weight, "adapters": adapters, "grads": grads, "rank": rank, "alpha": alpha}


@pytest.mark.dist
def test_lora_on_moe_experts_under_expert_parallelism(tmp_path):
    """LoRA on a tiny Qwen3-MoE at EP2 x DP2, at TP2 x DP2 with EP2 x ETP2 (each expert and its adapters split over two
    ranks), at TP2 with ETP1 and at TP1 with ETP2 (tests/multiprocess/workers/lora_moe_worker.py): logits equal the HF
    model with the adapters merged (1e-5), the adapters' gradients after megatron's DDP equal the merged model's
    (relative 1e-5), and megatron's optimizer's gradient norm is the norm of those gradients (relative 1e-5). Planted:
    at ETP1 the expert adapters marked as dense parameters (DDP averages two different experts); at ETP2 the experts'
    replicated factors without their gradient's all-reduce over expert TP; the grad-norm marks as before the fix (the
    norm then misses experts or counts a replicated factor twice where the expert TP is not the dense TP)."""
    torch.save(_merged_moe_case(tmp_path), tmp_path / "case.pt")
    out = run_torchrun("lora_moe_worker.py", 4, tmp_path / "case.pt", timeout=300).stdout
    found = {what: {(lay, int(r)): x for lay, r, x in re.findall(rf"{what} (\S+) rank (\d) max\w+ {FLOAT}", out)}
             for what in ("LORA_MOE_LOGITS", "LORA_MOE_GRAD", "PLANTED_MOE")}
    norms = {(lay, int(r)): (float(x), float(y))
             for lay, r, x, y in re.findall(rf"LORA_MOE_NORM (\S+) rank (\d) rel {FLOAT} planted {FLOAT}", out)}
    ranks = {("EP2DP2", r) for r in (0, 1)} | {(lay, r) for lay in ("TP2EP2ETP2DP2SP", "TP2EP2ETP1DP2SP", "DP4EP2ETP2")
                                               for r in range(4)}
    assert set(found["LORA_MOE_LOGITS"]) == set(found["LORA_MOE_GRAD"]) == ranks, out[-3000:]
    assert set(found["PLANTED_MOE"]) == {(lay, r) for lay, r in ranks if lay != "TP2EP2ETP1DP2SP"}, out[-3000:]
    assert set(norms) == {(lay, r) for lay, r in ranks if lay != "EP2DP2"}, out[-3000:]
    logits, grads, planted = (list(found[w].values()) for w in ("LORA_MOE_LOGITS", "LORA_MOE_GRAD", "PLANTED_MOE"))
    print(f"LoRA on experts at EP2, EP2 x ETP2, TP2 with ETP1, TP1 with ETP2: worst |logits diff| {worst(logits):.3e}, "
          f"worst relative grad error {worst(grads):.3e}, grad norm {max(x for x, _ in norms.values()):.3e}; planted "
          f"{found['PLANTED_MOE']}, grad-norm marks before the fix: {norms}")
    assert worst(logits) < 1e-5 and worst(grads) < 1e-5 and max(x for x, _ in norms.values()) < 1e-5
    assert all(float(x) > 1e-2 for x in planted), found["PLANTED_MOE"]
    assert all(y > 1e-2 for (lay, _), (_, y) in norms.items() if lay in ("TP2EP2ETP1DP2SP", "DP4EP2ETP2")), norms


@pytest.mark.dist
def test_tripod_train_with_actor_and_critic_lora(tmp_path):
    """`tripod train` (GAE with the KL penalty in the reward, DP2) with actor and critic LoRA: the reference is the
    actor with its adapters off (no reference model is built), the rollout gets the merged weights, and the run's
    losses are finite and its policy moves (the adapters train); its checkpoints record the adapters' settings and the
    base model's path."""
    import json
    import math

    from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
    from tests.helpers.trainer_runs import metrics, train

    setup = make_ppo_setup(tmp_path)
    run = str(tmp_path / "run")
    out = train(tiny_overrides(setup, run, world=2, steps=2) + [
        "actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.target_modules=[all-linear]",
        "critic.model.lora.rank=4", "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.save_freq=2"], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    for part in ("actor", "critic"):  # what `tripod export --lora / --merge` rebuilds the adapters from
        with open(f"{run}/checkpoints/global_step_2/{part}/tripod_checkpoint.json") as f:
            saved = json.load(f)["lora"]
        assert saved["rank"] == 4 and saved["base_model_path"] == setup["model"], saved
    _check_trained_export(run, setup["model"])
    steps = [m for m in metrics(run) if "actor/pg_loss" in m]
    assert len(steps) == 2, out.stdout[-3000:]
    for m in steps:
        assert all(math.isfinite(m[k]) for k in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm"))
    assert steps[0]["actor/ppo_kl"] > 0 and steps[0]["actor/grad_norm"] > 0


def _check_trained_export(run: str, base_dir: str) -> None:
    """The run's trained adapters through `tripod export --lora` (actor) and `--merge` (critic), in one 1-rank world:
    peft loads the adapter directory onto the base and its logits move off the base's; transformers loads the
    merged critic."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from tests.helpers.trainer_runs import tripod_in_one_world

    ckpt = f"{run}/checkpoints/global_step_2"
    tripod_in_one_world([["export", "--lora", f"{ckpt}/actor", f"{run}_peft"],
                         ["export", "--merge", f"{ckpt}/critic", f"{run}_critic_hf"]], 1)
    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, f"{run}_peft").eval()(ids).logits
        values = AutoModelForSequenceClassification.from_pretrained(f"{run}_critic_hf").eval()(ids).logits
    moved = (after - before).abs().max().item()
    assert moved > 1e-4 and values.shape == (1, 1) and bool(torch.isfinite(values).all()), (moved, values)
