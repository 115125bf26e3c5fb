"""The benchmarks, one module per benchmark (``eagle-jax bench NAME``; ``scripts/bench_*.py``
are shims), and their shared timing helpers (``timing``). ``rocm_compile``: the kernels'
ROCm compile report (``eagle-jax rocm-compile``)."""
