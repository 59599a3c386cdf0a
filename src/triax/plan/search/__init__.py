"""Finding plans: the layouts the validator accepts, one candidate-evaluation API
(evaluate.py) that both searches call, layer partitions, the exhaustive search,
the baselines every search reports, and plan files (emit.py)."""
