"""Queue a batch from another application and wait for it (a worker must be running:
``dflash-batch worker``). In that application's environment, install dflash-batch from its clone
(it is on no package index): ``pip install -e /path/to/dflash-batch``.

    python examples/enqueue.py [--target MODEL --draft DRAFTER]

Without --target the embedded default model pair is used. The job has its own name, so its own
output folder: its settings differ from the README's jobs on the same prompts, and an output
folder holds the results of one config.
"""

import argparse
import sys
from pathlib import Path

import dflash_batch
from dflash_batch.errors import InputError, SpecError

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--draft", default="auto")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()

    try:
        job = dflash_batch.submit(
            HERE / "prompts.jsonl",
            name="enqueue-example",
            target=args.target,
            draft=args.draft,
            max_tokens=64,
            system_prompt="You are a concise assistant.",
        )
    except (SpecError, InputError) as e:  # refused: nothing was queued
        sys.exit(f"enqueue.py: {e}")
    print("queued", job.id, "->", job.output_dir)
    status = job.wait(timeout=args.timeout)
    print(f"{status['state']}: {status['done']}/{status['total']} items done; "
          f"{status['rows']} rows: {status['ok']} ok, {status['failed']} failed; "
          f"decode tok/s (mean per row) {status['mean_decode_tps'] or 0:.1f}")  # fmt: skip
    df = job.to_pandas()
    print(df[["id", "status", "completion_tokens", "decode_tps", "acceptance_drafted"]].to_string(index=False))


if __name__ == "__main__":
    main()
