"""`sparrow bench`: Spec-Bench style speed benchmark of sparrow's drafters and transformers' peers.

data.py (questions, tasks), methods.py (method names, baselines), peers.py (transformers generate),
runner.py (timed runs -> JSONL rows), metrics.py (speedup, acceptance, exact match from rows),
report.py (markdown + PNG from rows), command.py (the typer command).
"""
