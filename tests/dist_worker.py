"""One rank of a test world: `python dist_worker.py RECIPE [--kill-at R:L] [--skip-rank R]`, launched with torchrun's env:// variables.

Optional faults for the tests: `--kill-at R:L` makes rank R SIGKILL itself when layer L
starts (a rank that dies mid-run); `--skip-rank R` makes rank R contribute zero
statistics (a broken reduction, which the equality test must catch);
`--recipe-for R:PATH` gives rank R another recipe; `--slow-main S` makes rank 0's merge and generation
take S seconds longer each (steps only rank 0 runs while the others wait).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--skip-rank", type=int, default=None)
    parser.add_argument("--recipe-for", default=None, help="R:PATH: rank R reads another recipe")
    parser.add_argument("--slow-main", type=float, default=None)
    args, rest = parser.parse_known_args()
    rank = int(os.environ["RANK"])
    if args.recipe_for is not None and int(args.recipe_for.split(":", 1)[0]) == rank:
        args.recipe = args.recipe_for.split(":", 1)[1]
    if args.kill_at is not None:
        import featcal_llm.engine.calibrate as calibrate

        victim, at = (int(v) for v in args.kill_at.split(":"))
        real = calibrate.calibrate_layer

        def dying(ctx, layer, tensors):
            if rank == victim and layer == at:
                print(f"killed at {time.time():.3f}", file=sys.stderr, flush=True)  # when, for measuring how fast the others stop
                os.kill(os.getpid(), signal.SIGKILL)
            return real(ctx, layer, tensors)

        calibrate.calibrate_layer = dying
    if args.skip_rank is not None:
        from featcal_llm.engine import torch_world as distributed

        real_reduce = distributed.TorchDistributed.reduce_statistics

        def skipping(self, stats, owners):
            if self.rank == args.skip_rank:
                for group in stats.values():
                    for tensor in distributed.statistics_tensors(group):
                        tensor.zero_()
                    group.tokens = 0
            return real_reduce(self, stats, owners)

        distributed.TorchDistributed.reduce_statistics = skipping
    if args.slow_main is not None and rank == 0:
        import featcal_llm.generation.run as generation
        import featcal_llm.stages.prepare as prepare

        def slowed(real):
            def slow(*a, **k):
                time.sleep(args.slow_main)
                return real(*a, **k)

            return slow

        generation.generated_sequences = slowed(generation.generated_sequences)
        prepare.ensure_merged = slowed(prepare.ensure_merged)
    from featcal_llm.cli import main as cli

    sys.argv = ["featcal-llm", "run", args.recipe, *rest]
    cli()


if __name__ == "__main__":
    main()
