"""End-to-end measurements of whole models running the kernels (scripts/e2e_decode.py)."""
