"""The w4a16 benchmark's own tools, on the CPU."""

import json
from pathlib import Path

from hubtools.bench.w4a16 import stand_in_table
from hubtools.workspace import Workspace


def test_a_table_stands_in_for_another_cards_only_in_the_build(load_kernel):
    """`--configs`: the H200 table read as another card's, then no table for it again (the heuristic); the files
    change in the kernel's build, never in the project's own configs folder."""
    k = load_kernel("w4a16")
    source = Workspace.load().kernel("w4a16").root / "torch-ext" / "w4a16" / "configs"
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    assert Path(k.tuning.CONFIG_DIR).resolve() != source.resolve()
    try:
        assert k.tuning.table("Some GPU") == {}
        stand_in_table(k, "Some GPU", source / "nvidia-h200.json")
        assert k.tuning.table("Some GPU") == json.loads((source / "nvidia-h200.json").read_text())
    finally:
        stand_in_table(k, "Some GPU", None)
    assert k.tuning.table("Some GPU") == {}
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
