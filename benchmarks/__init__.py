"""Benchmarks of dflash-batch against mlx-lm at real model shapes (``python -m benchmarks.run``).

Models are built in memory with random weights of the exact published configs
(``shapes.py``); acceptance is controlled as described in ``scripted.py``.
"""
