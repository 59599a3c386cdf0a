"""A plan's predicted step as a Chrome trace (opens in Perfetto)."""

from __future__ import annotations

from triax.plan.candidate import Estimate


def chrome_trace(estimate: Estimate) -> dict:
  """The predicted step in Chrome's trace format (Perfetto): the pipeline
  timeline of render.chrome_trace, then a 'tail' event per stage."""
  from triax.pipeline import render

  trace = render.chrome_trace(estimate.result)
  end = estimate.pipeline_time
  for s in range(estimate.plan.pipe):
    trace['traceEvents'].append(
      {
        'name': 'grad sync + optimizer',
        'cat': 'tail',
        'ph': 'X',
        'pid': 0,
        'tid': s,
        'ts': end * 1e6,
        'dur': estimate.tail_time * 1e6,
        'args': {'dp_allreduce_s': estimate.dp_allreduce_time},
      }
    )
  trace['otherData'].update(
    plan=estimate.plan.describe(),
    step_time_s=estimate.step_time,
    memory_bytes=list(estimate.memory),
    oom=estimate.oom,
  )
  return trace
