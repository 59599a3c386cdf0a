"""Experiment sweeps: many training runs from one config file, summarised as tables and plots.

A config file becomes a sweep by defining, next to `get_config(arg)`:

  def sweep(add, arg=None):
    for pipe in (1, 2, 4):
      add(**{'mesh.pipe': pipe, 'pipeline.microbatches': 2 * pipe})

Each `add` call is one point: config overrides keyed by their dotted config
path, exactly the keys of `--config.KEY=VALUE` flags (so the dict form,
`add(**{'a.b': 1})`, is the one convention). `python -m triax sweep` runs
every point as its own `triax train` process.

  runner   loads the sweep, names and runs the points (triax sweep calls it)
  results  reads each point's run back into rows; CSV and Markdown tables
  plots    loss curves, throughput and memory per point (PNG)
"""
