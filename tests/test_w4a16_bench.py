"""The w4a16 benchmark's own tools, on the CPU."""

import json

from hubtools.bench.w4a16 import stand_in_table
from hubtools.build import loaded_kernel
from hubtools.workspace import Workspace


def test_a_table_stands_in_for_another_cards_only_in_the_build():
    """`--configs`: the H200 table read as another card's, then no table for it (the heuristic), while the
    project's own configs folder keeps exactly the files it had."""
    project = Workspace.load().kernel("w4a16")
    shipped = project.root / "torch-ext" / "w4a16" / "configs"
    before = sorted(p.name for p in shipped.iterdir())
    h200 = shipped / "nvidia-h200.json"
    with loaded_kernel(project) as k:
        assert k.tuning.table("Some GPU") == {}
        stand_in_table(k, "Some GPU", h200)
        assert k.tuning.table("Some GPU") == json.loads(h200.read_text())
        stand_in_table(k, "Some GPU", None)
        assert k.tuning.table("Some GPU") == {}
        stand_in_table(k, "NVIDIA H200", None)  # a card's own table can be taken away too
        assert k.tuning.table("NVIDIA H200") == {}
    assert sorted(p.name for p in shipped.iterdir()) == before
