"""The memory-budget tool answers with measured peaks, and its answer follows them."""

import harness

from triax.compiled import budget


def test_budget_ranks_candidates_by_measured_memory():
  # Activation-heavy and deep enough per stage that recompute saves memory. BPipe
  # caps each stage at ceil((p+1)/2) = 3 residual sets against 1F1B's 4, of which
  # at p = 4 its transfer buffers take back part (tests/test_pipeline_memory.py):
  # measured, not assumed, it must not cost more.
  cfg = harness.tiny_config(
    **{
      'mesh.data': 2,
      'mesh.pipe': 4,
      'pipeline.microbatches': 8,
      'train.global_batch_size': 32,
      'model.seq_len': 64,
      'model.num_heads': 4,
    }
  )
  lines = []
  # A limit no candidate meets: every one is compiled, none is run.
  cands = {c.name.split(' (')[0]: c for c in budget.evaluate(cfg, 1, steps=1, say=lines.append)}
  assert len(lines) == len(cands) and all('not run' in line for line in lines), lines
  assert not any(c.step_time_s for c in cands.values())
  ref = cands['1f1b, no remat']
  assert not any(c.error for c in cands.values()), cands
  assert cands['1f1b, full remat'].peak_bytes < ref.peak_bytes
  # Megatron's selective recomputation keeps no [b, heads, s, s] probabilities
  # (4 heads x 64^2 per sequence against a 32-wide stream) in the stash: less.
  assert cands['1f1b, attention remat'].peak_bytes < ref.peak_bytes
  assert cands['bpipe, no remat'].peak_bytes <= 1.01 * ref.peak_bytes
  # Moments split over data (ZeRO-1) hold less. FSDP is measured but not
  # ordered: pipelined, it gathers the weights once per step, and the whole
  # gathered copy is live through the tick loop (at this size its peak is ZeRO-1's).
  assert cands['1f1b, ZeRO-1'].peak_bytes < ref.peak_bytes
  assert cands['1f1b, FSDP'].peak_bytes > 0
  # A limit just under the reference: the reference must not fit, the answer must.
  limit = ref.peak_bytes - 1
  for c in cands.values():
    c.step_time_s = 1.0 if c.fits(limit) else 0.0  # as evaluate() would have timed them
  text = budget.report(list(cands.values()), limit)
  answer = text.splitlines()[-1]
  assert answer.startswith('answer: ') and '(as configured)' not in answer
  chosen = next(c for c in cands.values() if c.name in answer)
  assert chosen.fits(limit)
  # The config as it is fits a limit at its peak: that is the answer, whatever the times.
  cands['1f1b, full remat'].step_time_s = 0.5
  answer = budget.report(list(cands.values()), ref.peak_bytes).splitlines()[-1]
  assert '(as configured): it fits; nothing to change' in answer
