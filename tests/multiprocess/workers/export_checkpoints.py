"""torchrun worker (1 rank): `tripod export CKPT OUT` for several checkpoints in one process.

argv: CKPT_1 OUT_1 [CKPT_2 OUT_2 ...]. Under torchrun the export runs in-process (engine/launch.py) in the world
this worker started, so N exports cost one interpreter start and one torch/megatron import instead of N CLI
subprocesses that each spawn their own rank. Prints `EXPORTED <out>` per checkpoint.
"""
import sys

from tests.helpers.common import dist_worker


def main() -> None:
    from tripod.engine.cli import main as tripod_main

    pairs = sys.argv[1:]
    assert pairs and len(pairs) % 2 == 0, f"expected CKPT OUT pairs, got {pairs}"
    for ckpt, out in zip(pairs[::2], pairs[1::2]):
        assert tripod_main(["export", ckpt, out]) == 0, f"tripod export {ckpt} {out} failed"
        print(f"EXPORTED {out}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
