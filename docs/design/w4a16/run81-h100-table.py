"""Make w4a16's H100 launch table from run 81 (docs/design/w4a16.md, eighteenth session): the H200 table's configs
timed on an H100 (`run81-h100-h200-table.json`) against the heuristic's on the same card in the same call
(`run81-h100-heuristic.json`); the heuristic's config replaces an entry where it was more than 3 % faster
(`hubtools.bench.w4a16.merge_compare`, the tuner's own merge rule). Run from the repository root:

    PYTHONPATH=. python docs/design/w4a16/run81-h100-table.py
"""

import json
from pathlib import Path

from hubtools.bench.w4a16 import merge_compare

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parents[2] / "w4a16" / "torch-ext" / "w4a16" / "configs"

table_run = json.loads((HERE / "run81-h100-h200-table.json").read_text())
heuristic_run = json.loads((HERE / "run81-h100-heuristic.json").read_text())
assert table_run["env"]["gpu"] == heuristic_run["env"]["gpu"] == "NVIDIA H100 80GB HBM3"

# One compare result: the H200 configs as the shipped launch, the heuristic's as the candidate.
rows = [row for row in table_run["rows"] if row["impl"] == "shipped"]
rows += [dict(row, impl="candidate") for row in heuristic_run["rows"] if row["impl"] == "shipped"]
compared = {**table_run, "rows": rows}

h200 = json.loads((CONFIGS / "nvidia-h200.json").read_text())
table = {"device": table_run["env"]["gpu"], "heuristic": h200["heuristic"], "shapes": h200["shapes"], "measured": []}
changes = merge_compare(table, compared)
table["measured"][-1]["command"] = (
    "docs/design/w4a16/run81-h100-table.py: the entries of configs/nvidia-h200.json (M buckets 8 and 32 not timed "
    "here), each replaced by the heuristic's config where that was > 3 % faster on this card in run 81 ("
    + table_run["env"]["command"] + ", once without and once with the H200 entries)")
(CONFIGS / "nvidia-h100-80gb-hbm3.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
print("\n".join(changes))
