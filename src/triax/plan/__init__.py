"""The planner (`python -m triax plan`), in three rooms and what they share.

  cost/      what a plan costs: profiles, roofline, collectives, memory, simulator;
  search/    layouts, the candidate-evaluation API, partitions, the exhaustive
             search, baselines, plan files;
  learned/   the learned planner: named features, policy, training.

Shared by all three: `cluster.py` (cluster specs) and `candidate.py` (`Plan`,
`Options`, `Estimate`: what a search proposes and the cost model prices).
`report.py` is `triax plan`'s library: it picks a search and prints its answer.
Imports go report -> learned -> search -> cost -> {cluster, candidate}.
"""
