"""Summarise Nsight Compute's CSV (``ncu --csv --page details``): a few metrics per kernel launch.

Run on the CSV that ncu wrote:

    python benchmarks/ncu_summary.py ncu.csv
"""

import argparse
import collections
import csv
import os

WANT = [
    "Duration",
    "SM Frequency",
    "Achieved Occupancy",
    "Theoretical Occupancy",
    "Registers Per Thread",
    "Compute (SM) Throughput",
    "DRAM Throughput",
    "L2 Hit Rate",
    "Dynamic Shared Memory Per Block",
    "Warp Cycles Per Issued Instruction",
    "Waves Per SM",
]


def main(path):
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    idx = {h: j for j, h in enumerate(rows[0])}
    per = collections.OrderedDict()
    for r in rows[1:]:
        r = r + [""] * (len(idx) - len(r))
        key = (
            r[idx["ID"]],
            r[idx["Kernel Name"]].split("(")[0].replace("custom_kernel_dflash_block_attn_", ""),
            r[idx["Grid Size"]],
            r[idx["Block Size"]],
        )
        if r[idx["Metric Name"]]:
            per.setdefault(key, {})[r[idx["Metric Name"]]] = (
                f"{r[idx['Metric Value']]} {r[idx['Metric Unit']]}".strip()
            )
    for key, m in per.items():
        print(*key, "|", "; ".join(f"{w}: {m[w]}" for w in WANT if w in m))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("csv", help="the CSV that ncu wrote")
    path = parser.parse_args().csv
    if not os.path.isfile(path):
        parser.error(f"csv: no such file: {path}")
    main(path)
