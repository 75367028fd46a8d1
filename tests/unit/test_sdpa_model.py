"""The core attention build_gpt_model puts into the local spec on CPU (issue 23): PyTorch SDPA for non-MLA families,
megatron's own for MLA, and a whole GPTModel with it equal to the same model with megatron's DotProductAttention.

* Which class runs: every layer of a tiny Qwen2 built on CPU has `SDPADotProductAttention`; `sdpa=False` (the tests'
  escape hatch, not a config key) gives megatron's `DotProductAttention`; a tiny DeepSeek-V2 (MLA) keeps megatron's
  local attention (MLALocalDotProductAttention); at context_parallel_size=2 the CP all-gather wraps the SDPA class.
* The same model, same weights (the HF checkpoint), forward + backward with each attention, on every mask tripod
  passes: left padding (causal | padded keys: the pad query rows are fully masked), shared-prompt packing
  (engine/workers/packing.py `pack_shared_prompts`) and padding-free packing with shared prompts (block-diagonal,
  positions per row). Compared: the logits of every position a head reads, and the gradient of every parameter of
  the loss sum(w * those logits) (w fixed, random). Bounds, fp32 (eps 1.2e-7): logits 1e-5 absolute (the model
  parity tests' bound against transformers; logits here are O(1)); each gradient tensor within 1e-5 of its largest
  element. The two attentions differ only in reduction order (scores, softmax normaliser, probs x V: sums of <= 64
  terms, a few ulps each), which two layers carry to the head as a few 1e-7.
* The bytes autograd saves in the forward of the shared-prompt micro-batch: within 5% of memory_plan's
  `activation_bytes` for the attention that runs (fused for SDPA, materialising for megatron's), the bound of
  tests/multiprocess/test_precision.py; at this sequence length the two attentions' plans differ by more than 10%.
Planted bugs (sdpa_attention.py, reverted): a doubled softmax scale and the first row's mask used for the whole
micro-batch (a packing leak) both fail the comparison.
"""
import subprocess
import sys
import textwrap

from tests.helpers.common import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from tripod.parallel.megatron_patches.cpu_compat import apply_cpu_compat
    apply_cpu_compat()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from tripod.runtime.memory import SavedTensorBytes
    from tripod.engine.workers.batch import build_ppo_batch
    from tripod.engine.workers.packing import pack_shared_prompts, pack_without_padding
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.megatron_patches.gpt_model import rope_with_slot_positions
    from tripod.parallel.memory_plan import activation_bytes
    from tripod.parallel.model import build_gpt_model, causal_attention_mask, model_layer_spec
    from tripod.parallel.model import transformer_config_from_arch
    from tripod.parallel.sdpa_attention import sdpa_dot_product_attention

    SDPA = sdpa_dot_product_attention()
    hf_dir, mla_dir = sys.argv[1], sys.argv[2]
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(tp=1, pp=1, name="actor", arch=arch)
    models = {}
    for sdpa in (True, False):
        model = build_gpt_model(arch, layout, sdpa=sdpa)
        assert not load_hf_weights(model, hf_dir, arch, layout)
        assert rope_with_slot_positions(model)
        models[sdpa] = model
    cores = {sdpa: {type(layer.self_attention.core_attention) for layer in m.decoder.layers}
             for sdpa, m in models.items()}
    assert cores == {True: {SDPA}, False: {DotProductAttention}}, cores

    mla = arch_from_hf(mla_dir)
    assert mla.mla is not None
    mla_model = build_gpt_model(mla, ParallelLayout(tp=1, pp=1, name="mla", arch=mla))
    kinds = {type(layer.self_attention.core_attention) for layer in mla_model.decoder.layers}
    assert len(kinds) == 1 and not issubclass(next(iter(kinds)), SDPA), kinds
    assert next(iter(kinds)).__name__ == "MLALocalDotProductAttention", kinds
    with layout.activate():
        cp_spec = model_layer_spec(arch, False, transformer_config_from_arch(arch, layout), cp=2)
    cp_core = cp_spec.submodules.self_attention.submodules.core_attention
    assert issubclass(cp_core, SDPA) and cp_core.__name__ == "ContextParallelSDPADotProductAttention", cp_core
    print("CORE_ATTENTION sdpa", SDPA.__name__, "mla", next(iter(kinds)).__name__, "cp", cp_core.__name__)

    g = torch.Generator().manual_seed(7)
    # left padding: rows of 9..24 real tokens at the right end of 24 slots
    s, lengths = 24, [24, 17, 9]
    real = torch.arange(s)[None, :] >= s - torch.tensor(lengths)[:, None]
    ids = torch.randint(3, arch.vocab_size, (len(lengths), s), generator=g) * real
    cases = {"left_padding": (ids, causal_attention_mask(s, real.long()), None, real.reshape(-1).nonzero()[:, 0])}
    # GRPO-like groups: 3 prompts (10..20 tokens) x 3 responses (4..16 tokens), shuffled
    prompts, responses = [], []
    for _ in range(3):
        p = torch.randint(3, arch.vocab_size, (int(torch.randint(10, 21, (1,), generator=g)),), generator=g).tolist()
        for _ in range(3):
            prompts.append(p)
            responses.append(torch.randint(3, arch.vocab_size, (int(torch.randint(4, 17, (1,), generator=g)),),
                                           generator=g).tolist())
    order = torch.randperm(len(prompts), generator=g).tolist()
    batch = build_ppo_batch([prompts[i] for i in order], [responses[i] for i in order], 16, 0, order)
    read = batch["response_mask"].bool()
    for name, packed in (("shared_prompts", pack_shared_prompts(batch)),
                         ("padding_free", pack_without_padding(batch, share_prompts=True))):
        assert packed is not None and packed.mask is not None and packed.mask.shape[0] > 1, name
        cases[name] = (packed.input_ids, packed.mask, packed.positions, packed.gather[read])

    exclude = {p.untyped_storage().data_ptr() for m in models.values() for p in m.parameters()}
    worst = {}
    for name, (ids, mask, positions, flat) in cases.items():
        runs = {}
        for sdpa, model in models.items():
            model.zero_grad(set_to_none=True)
            model.rotary_pos_emb.tripod_positions = positions
            pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            with layout.activate():
                with SavedTensorBytes(exclude) as saved:
                    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask)
                read_logits = logits.reshape(-1, logits.shape[-1])[flat]
                w = torch.randn(read_logits.shape, generator=torch.Generator().manual_seed(3))
                (read_logits * w).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            runs[sdpa] = (read_logits.detach(), grads, saved.peak)
        (out, grads, saved_sdpa), (ref, ref_grads, saved_ref) = runs[True], runs[False]
        logit_diff = (out - ref).abs().max().item()
        grad_rel = torch.stack([(grads[n] - g_ref).abs().max() / g_ref.abs().max()  # torch's max keeps a NaN
                                for n, g_ref in ref_grads.items()]).max().item()
        worst[name] = (logit_diff, grad_rel)
        print(f"SDPA_VS_MEGATRON {name} rows x slots {tuple(ids.shape)} read {flat.numel()} max|logit diff| "
              f"{logit_diff:.3e} (max|logit| {ref.abs().max().item():.3g}) worst grad diff / max|grad| {grad_rel:.3e}")
        if name == "shared_prompts":
            rows, seq = ids.shape
            fused = activation_bytes(arch, 1, 1, rows, seq, torch.float32)
            eager = activation_bytes(arch, 1, 1, rows, seq, torch.float32, fused_attention=False)
            saved_bytes = (saved_sdpa, fused, saved_ref, eager)
            print(f"SAVED_BYTES {rows} x {seq}: sdpa {saved_sdpa} planned {fused}; megatron {saved_ref} planned "
                  f"{eager}")
    for name, (logit_diff, grad_rel) in worst.items():
        assert logit_diff < 1e-5 and grad_rel < 1e-5, (name, logit_diff, grad_rel)
    saved_sdpa, fused, saved_ref, eager = saved_bytes
    assert abs(saved_sdpa / fused - 1) < 0.05 and abs(saved_ref / eager - 1) < 0.05, saved_bytes
    assert eager > 1.1 * fused  # the plans tell the two attentions apart at this length
    print("SDPA_MODEL_MATCHES_MEGATRON")
""")


def test_cpu_model_runs_sdpa_and_equals_megatrons_attention(tmp_path):
    from tests.helpers.common import free_port, make_tiny_hf_model
    from tests.helpers.moe_models import make_tiny_moe_model

    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=3, num_hidden_layers=2)
    mla_dir = make_tiny_moe_model(tmp_path, "deepseek_v2", num_hidden_layers=2)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, hf_dir, mla_dir, str(free_port())], cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith(("SDPA_VS", "SAVED", "CORE"))))
    assert proc.returncode == 0 and "SDPA_MODEL_MATCHES_MEGATRON" in proc.stdout, proc.stdout[-3000:]
