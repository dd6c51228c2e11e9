"""GPU benchmark harness: timing protocol, per-kernel cases, results files and reports."""
