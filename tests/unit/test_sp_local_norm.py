"""Sequence parallelism with megatron's local (non-TE) spec outside the CPU shims (issue 18 item 3).

On a GPU without Transformer Engine (or with megatron.use_te=false) the local spec's RMSNorm is megatron's
WrappedTorchNorm, which asserts `not config.sequence_parallel`; every MoE run at TP > 1 forces SP. The fix used to be
installed only by the CPU shims (apply_cpu_compat). Here a fresh interpreter that never applies them (what a GPU
process is) builds the norms of the layer spec tripod's model builder uses, from a TP2 + SP config."""
import subprocess
import sys
import textwrap

from tests.helpers.common import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import sys, types
    import torch
    from megatron.core.transformer.spec_utils import build_module
    from tripod.parallel.megatron_patches import cpu_compat
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.model import model_layer_spec, transformer_config_from_arch
    from tripod.parallel.stages import StageSplit

    arch = arch_from_hf(sys.argv[1])
    layout = types.SimpleNamespace(tp=2, pp=1, ep=1, etp=1, name="actor", validate_for=lambda a: None,
                                   stage_split=lambda n, vpp=None: StageSplit(n))
    config = transformer_config_from_arch(arch, layout, sequence_parallel=True)
    assert config.sequence_parallel
    spec = model_layer_spec(arch, False, config)
    assert not cpu_compat.cpu_compat_applied()  # a GPU process: no CPU shims
    for field in ("input_layernorm", "pre_mlp_layernorm"):
        norm = build_module(getattr(spec.submodules, field), config=config, hidden_size=arch.hidden_size,
                            eps=arch.rms_norm_eps)
        x = torch.randn(3, 2, arch.hidden_size)
        torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (arch.hidden_size,), norm.weight,
                                                                         arch.rms_norm_eps))
        assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters()), field  # grads summed over TP
    print("SP_NORM_OK")
""")


def test_local_spec_norm_builds_under_sequence_parallel_without_cpu_shims(tmp_path):
    from tests.helpers.common import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path, "qwen2")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and "SP_NORM_OK" in proc.stdout, proc.stdout[-3000:]
