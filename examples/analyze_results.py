"""Notebook-style look at a finished job with pandas (run cell by cell, or as a script).

    python examples/analyze_results.py JOB_ID_OR_OUTPUT_DIR
"""

# %% Load: a job id (looked up in $DFLASH_BATCH_HOME) or any output dir of Parquet parts.
import sys
from pathlib import Path

import pandas as pd

source = sys.argv[1] if len(sys.argv) > 1 else "."
if Path(source).is_dir():
    df = pd.read_parquet(source)
else:
    from dflash_batch.api import Job
    from dflash_batch.errors import JobNotFound

    try:
        df = Job(source).to_pandas()
    except JobNotFound as e:  # an unknown id, or a prefix of several: say so, no traceback
        sys.exit(f"analyze_results: {e}")
ok_rows, error_rows = df["status"].eq("ok").sum(), df["status"].eq("error").sum()
print(f"{df['id'].nunique()} items; {len(df)} rows (one per sample): "
      f"{ok_rows} ok, {error_rows} errors")

# %% Errors, with the line or row of the input they came from
errors = df[df["status"] == "error"]
if len(errors):
    print(errors[["id", "error"]].to_string(index=False))

# %% Speed and speculation per item. acceptance_drafted = accepted / drafted tokens;
# acceptance_generated = share of output tokens that came from the drafter;
# tokens_per_cycle = mean tokens committed per target verify pass (tau).
ok = df[df["status"] == "ok"]
cols = ["prompt_tokens", "completion_tokens", "decode_tps", "acceptance_drafted", "acceptance_generated", "tokens_per_cycle"]
print(ok[cols].describe().round(3).to_string())

# %% Token-weighted totals. Rows decode side by side, so the summed decode time is not the job's
# wall time: this is a per-row rate, token-weighted (status shows the plain mean per row; the
# run's bar shows whole-job output tok/s, all tokens over the elapsed time).
total_decode_s = ok["decode_s"].sum()
decode_tokens = (ok["completion_tokens"] - 1).clip(lower=0).sum()
print(f"decode tok/s (token-weighted per row): {decode_tokens / total_decode_s:.1f} "
      f"over {total_decode_s:.1f} s of row decode time")  # fmt: skip
print(f"decode tok/s (mean per row): {ok['decode_tps'].mean():.1f}")
print(f"acceptance (drafted): {ok['accepted_tokens'].sum() / max(ok['drafted_tokens'].sum(), 1):.3f}")

# %% Where speculation helps least: the prompts with the lowest acceptance
print(ok.nsmallest(5, "acceptance_drafted")[["id", "acceptance_drafted", "tokens_per_cycle", "decode_tps"]].to_string(index=False))

# %% Histogram of committed tokens per verify cycle, summed over items
hist = pd.DataFrame(ok["acceptance_histogram"].tolist()).fillna(0).sum().astype(int)
print(hist.rename("cycles").rename_axis("tokens committed").to_string())
