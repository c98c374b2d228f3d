"""Side-by-side benchmarks of keras-ema-opt against its peers.

Run ``python -m benchmarks`` (or ``keras-ema-opt bench``); see
``benchmarks/__main__.py`` and ``benchmarks/README.md``.
"""
