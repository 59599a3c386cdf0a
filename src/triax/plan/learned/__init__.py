"""The learned strategy maker (`--search=learned`): a policy trained against the simulator.

As HeteroG (Yi et al., CoNEXT'20) does, a graph network over the model's
layers and the cluster's device groups makes a plan as a sequence of
decisions, each a choice among candidates the config validator allows:

  features.py   the inputs by name, and the schema a policy file holds;
  decisions.py  the problem, its decisions (tensor, pipe, micro-batches,
                schedule and v, remat, state sharding, a device group per
                stage) and the plan they make, priced through the search's
                own API (plan/search/evaluate.py);
  policy.py     the network, and saving / loading it with its schema;
  training.py   REINFORCE against the simulator, rollouts and inference;
  catalogue.py  the random heterogeneous clusters it trains on;
  planner.py    its answer as a SearchResult, with the shared baselines.
"""
