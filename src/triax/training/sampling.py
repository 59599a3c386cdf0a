"""`triax sample`'s library: a run's latest parameters continuing a prompt.

The workdir's readers (training/workdir.py) give the config, tokenizer and
the newest checkpoint's params, checked as a resume checks them;
model/generation.py decodes.
"""

from __future__ import annotations

from triax.model import generation
from triax.training import workdir as workdir_lib


def sample(
  workdir: str,
  prompt: str,
  sampling: generation.Sampling,
  mesh: tuple[int, ...] | None = None,
) -> dict:
  """Restores a run's latest params and continues `prompt`.

  Everything about the input (workdir, checkpoint, prompt, sampling flags,
  mesh) is checked before JAX starts compiling. `mesh` = (data, tensor, pipe)
  or (data, context, tensor, pipe) samples on that many devices, the weights
  split and the prefill over context ranks (`generation.Placement`); None, on one.

  Returns:
    {'text': prompt + continuation, 'step': checkpoint step, 'tokens': new tokens}
  """
  cfg = workdir_lib.load_config(workdir)
  tok = workdir_lib.tokenizer(workdir, cfg)
  prompt_tokens = generation.encode_prompt(prompt, cfg.model.seq_len, tok)
  sampling.check(cfg.model.vocab_used or cfg.model.vocab_size)  # padded ids: never drawn
  placement = generation.Placement.build(cfg, mesh)
  model = generation.sampling_model(cfg)
  step, params = workdir_lib.restore_params(workdir, cfg, placement.shardings(model))
  new = generation.generate(model, params, prompt_tokens, sampling, placement)
  return {'text': tok.decode(prompt_tokens + new.tolist()), 'step': step, 'tokens': new}
