"""GPU benchmarks of the kernels: per-kernel cases and goals (<python_name>.py), results files (cli.py)."""

from . import moe_dispatch, rmsnorm, w4a16

# kernel name -> its bench module: run(module) measures the loaded kernel, goals(results) evaluates the rows
BENCHMARKS = {"rmsnorm": rmsnorm, "w4a16": w4a16, "moe-dispatch": moe_dispatch}
