"""Side-by-side benchmarks of ckpt-engine refits (``python -m benchmarks.run``), and the GPU
section (``python -m benchmarks.gpu``). Results land in ``benchmarks/results/``."""
