"""Defaults and validation of a run's configuration.

Experiment files (experiments/*.py) start from `defaults()` and change what
they need. `validate()` runs once, at the boundary, before anything is
compiled: every problem becomes a `ConfigError` naming the key and the fix,
and downstream code reads fields directly (no `.get(key, default)` chains).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import ml_collections

from triax import checks
from triax.data import checks as data_checks
from triax.errors import ConfigError
from triax.layout import CONTEXT_ATTENTION
from triax.model import registry
from triax.pipeline import schedule as sched
from triax.pipeline.rounds import PACKINGS
from triax.training import checks as train_checks

MESH_AXES = ('data', 'context', 'tensor', 'pipe')
# The mesh axis mesh.expert carves from data (mesh.build_mesh), when it is > 1.
EXPERT_AXIS = 'expert'
# Where the pipeline's two ends make their weight gradients (pipeline.edge_grads,
# executor.edge_grads_after_loop): in the tick loop, after it, or whichever holds fewer bytes.
EDGE_GRADS = ('auto', 'loop', 'after')
SCHEDULES = tuple(sched.SCHEDULES)
REMAT_POLICIES = ('none', 'attention', 'dots', 'full')
# model.remat values that were renamed: the value -> what to write instead.
RETIRED_REMATS = {
  'selective': (
    "is now 'dots' (keeps every weight matmul's output: what 'selective' was); "
    "Megatron's selective recomputation (the attention core only) is 'attention'"
  ),
}
# float16 is refused with its reason (no loss scaling); see validate().
DTYPES = ('float32', 'bfloat16')
ATTENTION_IMPLS = ('xla', 'cudnn', 'splash')
# model.fp8: the weight matmuls' operands as they are, or FP8 with one scale per tensor or per
# row from the tensor's own amax, or per tensor from past steps' amax (delayed).
FP8_RECIPES = ('none', 'tensorwise', 'rowwise', 'delayed')
# model.fp8_grad: the FP8 backward's cotangent format (model/fp8.py's GRAD_FORMATS).
FP8_GRADS = ('e5m2', 'e4m3')


def defaults() -> ml_collections.ConfigDict:
  """Every key a run may set, with a one-line reason for each default."""
  c = ml_collections.ConfigDict()

  c.mesh = ml_collections.ConfigDict()
  # Data-parallel degree; -1 takes whatever devices the other axes leave.
  c.mesh.data = -1
  # Context-parallel degree: every micro-batch's sequence is split this many ways for the
  # whole layer, attention included (model.context_attention says how attention meets).
  c.mesh.context = 1
  # Tensor (Megatron) parallel degree: heads and MLP columns are split this many ways.
  c.mesh.tensor = 1
  # Pipeline degree: number of pipeline stages.
  c.mesh.pipe = 1
  # Data-centre-network factor of each axis (multi-slice / multi-host); 1 = single slice.
  c.mesh.dcn_data = 1
  # DCN factor of the context axis; its all-gathers or ring transfers run every layer.
  c.mesh.dcn_context = 1
  # DCN factor of the tensor axis; keep 1 unless you know your network.
  c.mesh.dcn_tensor = 1
  # DCN factor of the pipe axis; pipelining tolerates slow links, so this is the usual one.
  c.mesh.dcn_pipe = 1
  # jax.devices() indices in mesh order (data, context, tensor, pipe; row-major); () = default.
  c.mesh.device_order = ()
  # FSDP / ZeRO-3: parameters (and their optimizer state) split over `data` along d_model,
  # gathered where used; the rule ('embed', 'data') in sharding.logical_axis_rules.
  c.mesh.fsdp = False
  # Megatron's sequence parallelism (Korthikanti et al. 2022): the activations outside the
  # tensor-parallel matmuls (norms, residuals) split along the sequence over `tensor` too;
  # each all-reduce becomes a reduce-scatter and an all-gather. Needs mesh.tensor > 1.
  c.mesh.sequence_parallel = False
  # Expert parallelism (mixtral): each MoE layer's experts split this many ways, carved from
  # the data-parallel devices (a divisor of mesh.data; tokens meet their experts by all-to-all).
  c.mesh.expert = 1

  c.model = ml_collections.ConfigDict()
  # Model family, one file each in triax/model/: gpt (learned positions, GELU MLP, full
  # multi-head attention), llama (RoPE, SwiGLU, grouped-query attention, RMSNorm) or
  # mixtral (llama with a mixture of SwiGLU experts for each MLP) or deepseek (multi-head
  # latent attention, DeepSeekMoE with loss-free balancing, multi-token prediction) or
  # gemma3 (Gemma 3's text model: local and global layers, pre- and post-norms, GeGLU).
  c.model.family = 'gpt'
  # Number of transformer blocks.
  c.model.num_layers = 4
  # Residual stream width (h in the Megatron FLOPs formula).
  c.model.d_model = 128
  # Attention heads; must divide by mesh.tensor.
  c.model.num_heads = 4
  # Width of each attention head; 0 = d_model / num_heads (Qwen3 widens it).
  c.model.head_dim = 0
  # MLP hidden width; must divide by mesh.tensor.
  c.model.d_ff = 512
  # Vocabulary size; 256 for the byte-level corpus.
  c.model.vocab_size = 256
  # Ids the tokenizer uses; those from it up to vocab_size are padding, masked out of the loss
  # and of sampling; 0 = all of vocab_size (the data check asks for it when they differ).
  c.model.vocab_used = 0
  # Tokens per sequence (learned position embeddings of this length).
  c.model.seq_len = 128
  # Compute dtype of activations and matmuls: float32 or bfloat16 (float16 is refused).
  c.model.dtype = 'float32'
  # Storage dtype of parameters and optimizer state; float32 with bfloat16 compute = fp32 masters.
  c.model.param_dtype = 'float32'
  # Activation recomputation: none; attention (Megatron's selective: recompute the attention
  # core's scores only); dots (keep every weight matmul's output, recompute the rest); full
  # (keep each layer's input).
  c.model.remat = 'none'
  # Weight matmuls in FP8 (model/fp8.py): none, tensorwise (current scaling, one power-of-two
  # scale per tensor from its amax each step; E4M3 operands forward, E5M2 gradients backward) or
  # rowwise (the same, one scale per row of each GEMM: the amax over its contracting axes) or
  # delayed (Transformer Engine's: one scale per tensor from the max of the last
  # model.fp8_amax_history steps' amax; model/fp8_delayed.py; the routed experts scale as
  # tensorwise). Routed experts included; attention's core,
  # norms, router and the head stay in model.dtype.
  c.model.fp8 = 'none'
  # The FP8 backward's cotangents (only with model.fp8): e5m2 (2 mantissa bits, max 57344: the
  # recipe of Transformer Engine's HYBRID and torchao's tensorwise) or e4m3 (3 bits, max 448:
  # DeepSeek-V3's; mixtral_tiny's tensorwise run stays near bf16 with it, docs/bench_fp8.md).
  c.model.fp8_grad = 'e5m2'
  # model.fp8=delayed's history length in steps (only with delayed): TE's and flax's default.
  c.model.fp8_amax_history = 1024
  # Log each weight-matmul kind's FP8 amax and scales and the casts' overflow fractions
  # (model/fp8_metrics.py); needs model.fp8 and, for now, no pipeline or micro-batches.
  c.model.fp8_metrics = False
  # Run the layer stack as a loop (true) or unrolled (false: longer compiles; XLA may then overlap
  # one layer's collectives with another's compute, and with the other micro-batch's in a fused
  # pipeline tick, pipeline.fuse_overlaps). MaxText's scan_layers.
  c.model.scan_layers = True
  # Attention kernel: xla everywhere, cudnn (fused, GPU only) or splash (Pallas's flash
  # attention for TPU: no [b, n, s, s] scores in memory).
  c.model.attention = 'xla'
  # splash: run the kernel through Pallas's interpreter, on any backend (tests; slow).
  c.model.splash_interpret = False
  # With mesh.context > 1, how a rank's queries meet the other ranks' keys: allgather (Llama 3's
  # and MaxText's: K/V gathered over `context` each layer) or ring (K/V blocks passed around
  # the ring, an online softmax, the next block's transfer beside this block's work).
  c.model.context_attention = 'allgather'
  # Cross-entropy over this many positions at a time (a divisor of seq_len), so a large
  # vocabulary's fp32 logits never exist for the whole micro-batch; 0 = all at once.
  c.model.loss_chunk = 0
  # llama: K/V heads (grouped-query attention), a divisor of num_heads; 0 = num_heads.
  c.model.num_kv_heads = 0
  # llama: RoPE base; Llama 3's 500000 (Llama 2 used 10000), what its checkpoints expect.
  # gemma3: the global layers' base (Gemma 3's 1000000).
  c.model.rope_theta = 500000.0
  # gemma3: RoPE base of the local (sliding-window) layers, unscaled (Gemma 3's
  # rope_local_base_freq); model.rope_scaling applies to the global layers only.
  c.model.rope_local_theta = 10000.0
  # gemma3: attention scores are q.k / sqrt(this) (Gemma 3's query_pre_attn_scalar); 0 = head_dim.
  c.model.query_pre_attn_scalar = 0.0
  # llama, deepseek: long-context RoPE scaling (transformers' rope_scaling / rope_parameters).
  c.model.rope_scaling = ml_collections.ConfigDict()
  # llama3 (Llama 3.1's frequency bands), yarn (YaRN: DeepSeek-V3's and V2's, Qwen3's long
  # context) or linear (every frequency / factor: Gemma 3's); another kind's key keeps its default.
  c.model.rope_scaling.rope_type = 'llama3'
  # Slow-down of the long wavelengths (Llama 3.1: 8, 3.2: 32; DeepSeek-V3: 40); 0 = no scaling.
  c.model.rope_scaling.factor = 0.0
  # llama3: wavelengths above original_max_position_embeddings / low_freq_factor scaled fully.
  c.model.rope_scaling.low_freq_factor = 1.0
  # llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept.
  c.model.rope_scaling.high_freq_factor = 4.0
  # The context length the model was pre-trained on before scaling.
  c.model.rope_scaling.original_max_position_embeddings = 8192
  # yarn: dimensions turning more than beta_fast times over that context keep their frequency,
  c.model.rope_scaling.beta_fast = 32.0
  # yarn: those turning fewer than beta_slow times are slowed by factor; a linear ramp between.
  c.model.rope_scaling.beta_slow = 1.0
  # yarn: with mscale_all_dim, cos and sin are scaled by m(mscale) / m(mscale_all_dim), where
  # m(x) = 0.1 x ln(factor) + 1; else by m(1). 0 = unset.
  c.model.rope_scaling.mscale = 0.0
  # yarn: that ratio's denominator; deepseek also scales the softmax by m(mscale_all_dim)^2
  # (every q.k dimension, as transformers' yarn_apply_mscale). 0 = unset.
  c.model.rope_scaling.mscale_all_dim = 0.0
  # llama: RMSNorm epsilon (transformers' Llama default; gpt's is fixed at 1e-6).
  c.model.norm_eps = 1e-5
  # llama: use the embedding table as the output layer (Llama 3.2 1B/3B do).
  c.model.tie_embeddings = False
  # llama: biases on the q, k and v projections (Qwen2's and Qwen2-MoE's).
  c.model.qkv_bias = False
  # llama: RMSNorm on each head's q and k before the rotation (Qwen3's and Qwen3-MoE's).
  c.model.qk_norm = False
  # llama: positions a local layer's query attends to, its own included (Mistral's sliding
  # window); 0 = none, every layer attends to the whole sequence. gemma3: 1..seq_len, required
  # (its local layers keep their own RoPE base even where the window spans the sequence).
  c.model.sliding_window = 0
  # llama, with sliding_window: every Nth layer global, the rest local (Gemma 3's 6: layer i
  # when (i + 1) % N == 0); 0 = every layer local (Mistral's).
  c.model.sliding_window_pattern = 0
  # mixtral (llama's keys too): experts per MoE layer, each a SwiGLU of width d_ff.
  c.model.num_experts = 8
  # mixtral: experts each token runs (top-k of the router's softmax, renormalised: Mixtral's).
  c.model.experts_per_token = 2
  # mixtral: always-on shared experts beside the routed ones (DeepSeek / Qwen MoE); 0 = none.
  c.model.shared_experts = 0
  # mixtral: the shared experts' output scaled by a learnt sigmoid gate of the token (Qwen2-MoE's).
  c.model.shared_expert_gate = False
  # mixtral: renormalise the k chosen experts' weights to sum to 1 (Mixtral's); false keeps
  # their softmax probabilities (Qwen2-MoE's norm_topk_prob=false).
  c.model.norm_topk_prob = True
  # mixtral: a MoE MLP in every n-th block (Qwen2-MoE's decoder_sparse_step: block i when
  # (i + 1) % n == 0), Llama's dense MLP of width d_ff in the others; divides num_layers.
  c.model.moe_every = 1
  # mixtral: dropless (tokens sorted by expert, grouped matmuls, none dropped) or capacity
  # (Switch/GShard buffers of capacity_factor x the even share per batch row; overflow dropped).
  c.model.moe_dispatch = 'dropless'
  # mixtral, capacity dispatch: an expert's buffer over the even share s*k/E of a row.
  c.model.capacity_factor = 1.25
  # mixtral: weight of the load-balancing loss (Switch's, as transformers computes it).
  c.model.router_aux_loss_coef = 0.01
  # mixtral: what the load-balancing loss balances over: batch (transformers': every layer's
  # rows of the whole batch at once) or microbatch (Megatron's: each layer over each
  # micro-batch, averaged; what the pipeline executor computes, stage by stage).
  c.model.router_aux_loss_scope = 'batch'
  # mixtral: weight of the router z-loss (ST-MoE: mean logsumexp(router logits)^2).
  c.model.router_z_loss_coef = 0.001
  # mixtral: weight of DeepSeek-V3's sequence-wise balance loss (each row's sum_e f_e P_e,
  # 1 when balanced; V3 adds it at 0.0001 beside loss-free balancing); 0 = off.
  c.model.router_seq_aux_loss_coef = 0.0
  # deepseek (mixtral's keys too, but model.shared_expert_gate and moe_every): MLA's query
  # down-projection width (q_lora_rank, with its RMSNorm); 0 = queries projected directly
  # (DeepSeek-V2-Lite's).
  c.model.q_lora_rank = 0
  # deepseek: width of the K/V latent (kv_lora_rank): what a token's keys and values are made
  # from, and what the decoding cache holds per token (beside the rope key).
  c.model.kv_lora_rank = 512
  # deepseek: per-head query/key dimensions without position (qk_nope_head_dim).
  c.model.qk_nope_head_dim = 128
  # deepseek: per-head query dimensions rotated by RoPE, and the one rotated key all heads share.
  c.model.qk_rope_head_dim = 64
  # deepseek: per-head value width (v_head_dim).
  c.model.v_head_dim = 128
  # deepseek: width of each routed and shared expert (moe_intermediate_size); 0 = d_ff, which
  # is the dense blocks' MLP width.
  c.model.moe_d_ff = 0
  # deepseek: the first k blocks have a dense MLP (first_k_dense_replace); num_layers counts them.
  c.model.first_k_dense = 0
  # deepseek: expert groups for group-limited routing (n_group); 1 = all experts one group.
  c.model.n_group = 1
  # deepseek: groups a token's experts may come from, the best by their two best experts.
  c.model.topk_group = 1
  # deepseek: the chosen experts' weights are scaled by this (routed_scaling_factor).
  c.model.routed_scaling_factor = 1.0
  # deepseek: auxiliary-loss-free balancing: after each step every layer's expert bias moves
  # by this x sign(mean load - expert load); 0 = the bias stays (DeepSeek-V3: 0.001).
  c.model.bias_update_rate = 0.001
  # deepseek: multi-token prediction modules after the last block (DeepSeek-V3: 1); 0 = none.
  # Training only: evaluation and sampling use the model's head alone.
  c.model.mtp_depth = 0
  # deepseek: weight of the MTP modules' mean cross-entropy in the objective (V3: 0.3, then 0.1).
  c.model.mtp_loss_weight = 0.3

  c.pipeline = ml_collections.ConfigDict()
  # Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, bpipe, zb_h1, interleaved_zb, zb_v,
  # v_min, v_half, v_zb, dualpipe_v, bpipe_zb (pipeline/schedules/'s SCHEDULES; a test holds
  # this list to it).
  c.pipeline.schedule = '1f1b'
  # A schedule file to run instead (torch's compute-only .csv or triax's .json); '' = by name.
  c.pipeline.schedule_file = ''
  # Micro-batches per step (m); the global batch is split into this many.
  c.pipeline.microbatches = 1
  # Virtual stages per device (v): model chunks each pipeline device holds.
  c.pipeline.virtual_stages = 1
  # Layers of each model chunk in chunk order (p*v ints summing to num_layers); () = even split.
  c.pipeline.layers_per_stage = ()
  # Megatron's scatter/gather: an activation or gradient crossing stages travels (and waits)
  # split over `tensor`, 1/t per rank, and is all-gathered where it is used.
  c.pipeline.scatter_gather = True
  # Where the embedding's and head's weight gradients are made: loop (in the tick loop, an fp32
  # accumulator of the edge weights carried through it), after (after it, each stage taking
  # 1/p of the micro-batches from pools of their activations), auto (whichever holds fewer bytes).
  c.pipeline.edge_grads = 'auto'
  # Keep the stash (each micro-batch's residuals between its F and its B and W) in host memory
  # (pinned_host), copied out after the F and back before the B and the W (PipeOffload);
  # not with a schedule that moves residual sets between stages (bpipe, bpipe_zb).
  c.pipeline.offload_stash = False
  # Run each overlapped pair a schedule marks (dualpipe_v's (F;B), a file's OVERLAP_F_B) in one
  # tick: one micro-batch's B and its W, then another's F, in one computation, where XLA may hide
  # an expert-parallel all-to-all of one under the other's compute. The tick lasts all three, so
  # on a dense model it lengthens the step (docs/bench_moe.md); false runs them in three ticks.
  c.pipeline.fuse_overlaps = False
  # How the lockstep program packs ticks: auto (where the model recomputes its forward in B,
  # model.remat=full, a round gives each stage actions worth the same time, so a stage's B lasts
  # its neighbours' W and F; pipeline/rounds.py), off (one action per stage per tick, the
  # papers' lowering). A schedule that fuses pairs or moves residual sets runs off either way.
  c.pipeline.tick_packing = 'auto'

  c.train = ml_collections.ConfigDict()
  # Optimizer steps to run in total (a resumed run stops at the same step).
  c.train.steps = 200
  # Sequences per optimizer step, over all data-parallel replicas.
  c.train.global_batch_size = 32
  # Peak learning rate reached after warmup.
  c.train.learning_rate = 3e-3
  # Linear warmup steps from 0 to the peak, before the schedule's own shape (every schedule).
  c.train.warmup_steps = 20
  # After warmup: cosine, linear (decay to the end), constant (the peak) or wsd
  # (warmup-stable-decay: the peak, then a linear decay over train.decay_fraction).
  c.train.lr_schedule = 'cosine'
  # wsd: the final fraction of train.steps that decays linearly to min_lr_ratio * peak
  # (a fifth of the run matched cosine's loss in Hagele et al. 2024, arXiv:2405.18392).
  c.train.decay_fraction = 0.2
  # Final learning rate of the cosine, linear and wsd decays, as a fraction of the peak.
  c.train.min_lr_ratio = 0.1
  # adamw, muon (Muon on the hidden matrices, AdamW on the rest), lion, adafactor or
  # schedule_free_adamw, all from optax (training/optimizer.py; docs/bench_optimizers.md).
  c.train.optimizer = 'adamw'
  # Decoupled weight decay (times the learning rate) of the matrices; biases, norms and
  # scalars never decay (training/optimizer.py: the rule reads logical axes, not names).
  c.train.weight_decay = 0.1
  # Adam first-moment decay (adamw, and muon's AdamW part).
  c.train.adam_b1 = 0.9
  # Adam second-moment decay (adamw, muon's AdamW part, schedule_free_adamw).
  c.train.adam_b2 = 0.95
  # muon: momentum decay (Nesterov) of the orthogonalised matrices.
  c.train.muon_beta = 0.95
  # muon: Newton-Schulz iterations per orthogonalisation.
  c.train.muon_ns_steps = 5
  # muon: the update times this x sqrt(max(fan_in, fan_out)), Moonlight's match of AdamW's
  # update RMS (0.2), so both parts share one learning rate; 0 = sqrt(max(1, out/in)) (Jordan's).
  c.train.muon_rms_scale = 0.2
  # muon: parameter names (a leaf's last key, e.g. ('router',)) left to AdamW.
  c.train.muon_exclude = ()
  # lion: the interpolation of momentum and gradient whose sign is the update.
  c.train.lion_b1 = 0.9
  # lion: the momentum's decay.
  c.train.lion_b2 = 0.99
  # adafactor: the second moment's decay exponent (decay 1 - step^-rate).
  c.train.adafactor_decay_rate = 0.8
  # adafactor: clip each layer matrix's update to this RMS; 0 = off.
  c.train.adafactor_clipping_threshold = 1.0
  # schedule_free_adamw: the interpolation of the gradient's point between the average and z.
  c.train.schedule_free_b1 = 0.9
  # replicated, or data: the optimizer's state (Adam's moments) sharded over the data axis
  # (ZeRO-1, Megatron's distributed optimizer); the update all-gathers the parameters it changes.
  c.train.optimizer_sharding = 'replicated'
  # Keep the optimizer state in host memory (pinned_host) between steps, brought to the
  # device for the update after the backward: its bytes leave the accelerator while the
  # forward and backward run. Needs a backend with host memory (TPU, GPU; CPU for tests).
  c.train.offload_optimizer = False
  # Global-norm gradient clipping threshold; 0 disables clipping.
  c.train.grad_clip_norm = 1.0
  # Seed for parameters and data order: the same seed gives identical losses.
  c.train.seed = 0
  # Evaluate the validation loss every this many steps (and at the end).
  c.train.eval_every = 50
  # Validation batches per evaluation.
  c.train.eval_batches = 4
  # Micro-batches an evaluation forwards each batch in, one after another, each one's rows
  # split over the data and pipe ranks (training/checks.eval_split); they must divide the rows a
  # device evaluates. 0 = as many as keep one no larger than the train step's micro-batch.
  c.train.eval_microbatches = 0
  # Write a metrics line every this many steps.
  c.train.log_every = 10
  # Multi-process runs: a process whose own step time (its step less its host-side waits, plus
  # the median process's waits) exceeds straggler_ratio x the median for straggler_steps
  # consecutive steps is named in one line (training/stragglers.py).
  c.train.straggler_ratio = 1.2
  c.train.straggler_steps = 10
  # NaN/Inf steps to skip (state kept, logged as skipped_nonfinite) before stopping; 0 stops at the first.
  c.train.skip_nonfinite_steps = 0
  # Roll back to the newest checkpoint before K consecutive bad steps (non-finite or spiking) and
  # skip the batches they read (recorded in DIR/rollbacks.jsonl; data order otherwise kept); 0 = off.
  c.train.spike_rollback = 0
  # A step spikes when its loss > spike_threshold x the mean of the last spike_window good losses.
  c.train.spike_threshold = 2.0
  # Good (finite, non-spiking) losses in that mean; no step spikes before there are this many.
  c.train.spike_window = 20
  # Rollbacks in a run (DIR/rollbacks.jsonl counts them) before a bad run of steps stops it.
  c.train.spike_max_rollbacks = 5
  # Write DIR/samples.jsonl: the window ids of each step's global batch (data accounting).
  c.train.record_sample_ids = False
  # Weights & Biases project to log to as well ('' = off; needs the wandb extra).
  c.train.wandb_project = ''
  # W&B mode: online (needs `wandb login`) or offline (DIR/wandb, upload with `wandb sync`).
  c.train.wandb_mode = 'online'

  c.data = ml_collections.ConfigDict()
  # stdlib: Python's own standard-library source (no download); text: data.path, as bytes;
  # tokens: a python -m triax prepare directory; megatron: a Megatron-LM .bin/.idx pair;
  # mixture: the sources of data.mixture, interleaved by weight.
  c.data.source = 'stdlib'
  # text: a file or directory; tokens: the prepared directory; megatron: the .bin/.idx PREFIX.
  c.data.path = ''
  # bytes, a Hugging Face tokenizer.json or a sentencepiece .model: what the tokens were made with.
  c.data.tokenizer = 'bytes'
  # data.source=text reads at most this many bytes and refuses more (never a silent prefix).
  c.data.max_text_bytes = 2**30
  # Attention stays inside each document of a packed row (sources that record documents).
  c.data.mask_documents = False
  # data.source=mixture: ((PATH, WEIGHT), ...), each PATH a prepared directory or Megatron prefix.
  c.data.mixture = ()

  c.checkpoint = ml_collections.ConfigDict()
  # Save a checkpoint every this many steps (and at the end); 0 saves only at the end.
  c.checkpoint.every_steps = 100
  # Checkpoints to keep; older ones are deleted once a newer one is complete.
  c.checkpoint.keep = 3
  # Also save once this many seconds of wall time have passed since the last save; 0 = off.
  c.checkpoint.every_seconds = 0.0
  # Save at multiples of this step and keep those forever (milestones retention skips); 0 = off.
  c.checkpoint.keep_every_steps = 0

  c.hardware = ml_collections.ConfigDict()
  # Peak FLOP/s of one device for MFU; 0 looks it up from the device kind (none on CPU).
  c.hardware.peak_flops_per_device = 0.0

  c.sharding = ml_collections.ConfigDict()
  # Logical axis -> mesh axis (or None = replicated). The model names only logical axes.
  c.sharding.logical_axis_rules = (
    ('batch', 'data'),
    ('vocab', 'tensor'),
    ('heads', 'tensor'),
    ('mlp', 'tensor'),
    ('kv', None),
    # llama's K/V heads: validate() replicates them instead when fewer than the axis size.
    ('kv_heads', 'tensor'),
    # mixtral's experts (their weights' leading axis): every device holds all of them.
    ('experts', None),
    ('embed', None),
    # Positions inside the tensor-parallel regions (Q/K/V, the MLP's hidden units, logits).
    ('seq', 'context'),
    # Positions of the residual stream between them (norms, residual adds, what a pipeline
    # sends): mesh.sequence_parallel makes it ('context', 'tensor').
    ('residual_seq', 'context'),
    # The learned position table's rows (gpt): whole on every device.
    ('positions', None),
    ('layers', None),
    ('stage', 'pipe'),
    ('virtual', None),
  )
  return c


def flatten(cfg, prefix: str = '') -> dict:
  """A ConfigDict (or dict) as {dotted key: leaf value}."""
  out = {}
  for key, value in cfg.items():
    name = f'{prefix}{key}'
    if hasattr(value, 'items'):
      out.update(flatten(value, name + '.'))
    else:
      out[name] = value
  return out


def set_dotted(cfg: ml_collections.ConfigDict, key: str, value) -> None:
  """Sets the leaf at a dotted key ('train.steps') in place: the one way every
  tool (sweeps, plans, the budget) overrides a config.

  Raises:
    ConfigError(key, ...): no such leaf (a misspelling or a group), or a
      value the leaf's type refuses.
  """
  *path, name = key.split('.')
  node = cfg
  for part in path:
    node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
  if not isinstance(node, ml_collections.ConfigDict) or name not in node:
    raise ConfigError(
      key, 'unknown config key; keys are dotted config paths like mesh.data or train.steps'
    )
  if isinstance(node[name], ml_collections.ConfigDict):
    raise ConfigError(key, 'names a config group, not a value')
  try:
    node[name] = value
  except (TypeError, ValueError) as e:
    raise ConfigError(key, f'{value!r} does not fit this key: {e}') from None


def _tuples(value):
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def load_json(path: str, key: str = '--workdir') -> ml_collections.ConfigDict:
  """A config saved as JSON (a run's config.json) over today's defaults.

  Keys the file lacks (written by an older triax) keep their defaults; JSON's
  lists become the tuples the defaults hold.

  Raises:
    ConfigError(key, ...): unreadable, or a key this triax does not know.
  """
  import json

  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(key, f'{path}: not a readable config ({e})') from None
  cfg = defaults()
  for dotted, value in flatten(saved).items():
    try:
      set_dotted(cfg, dotted, _tuples(value))
    except ConfigError as e:
      raise ConfigError(key, f'{path}: {e.key}: {e.message}') from None
  return cfg


def parse_arg(arg: str | None, **defaults) -> dict:
  """Parses a config file's `key=value,key=value` argument (big_vision style).

  Values are read as Python literals where they parse (ints, floats, True),
  else kept as strings. Keys must be among `defaults`, whose values they replace.
  """
  import ast

  out = dict(defaults)
  for item in filter(None, (arg or '').split(',')):
    key, sep, value = item.partition('=')
    key = key.strip()
    if key not in defaults:
      raise ConfigError(
        '--config', f'unknown config argument {key!r}; known: {", ".join(sorted(defaults))}'
      )
    if not sep:
      out[key] = True
      continue
    try:
      out[key] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      out[key] = value.strip()
  return out


def load_module(path: str):
  """Executes a config file (it is Python code) and returns it as a module.

  Raises:
    ConfigError: naming the file, when it is missing or fails to run.
  """
  import importlib.util
  import os
  import re

  if not os.path.isfile(path):
    raise ConfigError('--config', f'{path}: no such file')
  name = 'triax_config_' + re.sub(r'\W', '_', os.path.splitext(os.path.basename(path))[0])
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except ConfigError:
    raise
  except Exception as e:  # a config file is user code: report any failure as bad input
    raise ConfigError('--config', f'could not load {path}: {type(e).__name__}: {e}') from None
  return module


def from_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of another config file, for files that build on it."""
  return load_module(path).get_config(arg)


def resolve_mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, ...]:
  """Mesh sizes in MESH_AXES order (data, context, tensor, pipe), a -1 entry resolved to the rest."""
  sizes = [mesh_cfg[a] for a in MESH_AXES]
  for axis, size in zip(MESH_AXES, sizes):
    if not isinstance(size, int) or size == 0 or size < -1:
      raise ConfigError(f'mesh.{axis}', f'must be a positive integer or -1, got {size!r}')
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1:
    raise ConfigError(f'mesh.{MESH_AXES[free[1]]}', 'only one mesh axis may be -1')
  known = math.prod(s for s in sizes if s != -1)
  if free:
    if num_devices % known:
      raise ConfigError(
        f'mesh.{MESH_AXES[free[0]]}',
        f'-1 cannot fill {num_devices} devices: the other axes multiply to {known}',
      )
    sizes[free[0]] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ConfigError(
      'mesh',
      f'data*context*tensor*pipe = {"*".join(map(str, sizes))} = {math.prod(sizes)} '
      f'but there are {num_devices} devices; make the product {num_devices} '
      '(or set one axis to -1)',
    )
  return tuple(sizes)


def _check_expert(mesh_cfg, family: str) -> None:
  """mesh.expert: a divisor of the data-parallel degree inside one slice, for a MoE family."""
  expert = mesh_cfg.expert
  checks.positive_int('mesh.expert', expert)
  if expert == 1:
    return
  if family not in registry.FAMILIES or not registry.reads(family, 'num_experts'):
    raise ConfigError('mesh.expert', f'model.family={family} has no experts to split; set it to 1')
  within = mesh_cfg.data // mesh_cfg.dcn_data
  if within % expert:
    raise ConfigError(
      'mesh.expert',
      f'{expert} must divide the data-parallel devices of one slice (mesh.data / '
      f'mesh.dcn_data = {within}): it is carved from them, and its all-to-all runs every layer',
    )


def _check_device_order(mesh_cfg, num_devices: int) -> None:
  """mesh.device_order: empty, or each device index exactly once."""
  order = mesh_cfg.device_order
  if not order:
    return
  if (
    not isinstance(order, (list, tuple))
    or not all(isinstance(i, int) and not isinstance(i, bool) for i in order)
    or sorted(order) != list(range(num_devices))
  ):
    raise ConfigError(
      'mesh.device_order',
      f'must list each of the {num_devices} device indices 0..{num_devices - 1} '
      f'once (mesh order: data, context, tensor, pipe), or be () for the default; '
      f'got {order!r}',
    )
  if any(mesh_cfg[f'dcn_{a}'] > 1 for a in MESH_AXES):
    raise ConfigError(
      'mesh.device_order',
      'cannot be combined with mesh.dcn_* > 1 (the '
      'hybrid mesh places devices itself); set one of them to its default',
    )


@functools.cache
def _read_only_defaults() -> ml_collections.ConfigDict:
  """defaults(), built once for validate's comparisons (a planner's search
  validates thousands of layouts; building the defaults is most of each).
  Read it, never change it."""
  return defaults()


def validate(cfg: ml_collections.ConfigDict, num_devices: int) -> ml_collections.ConfigDict:
  """Checks `cfg` against itself and the device count; returns it with the mesh resolved.

  Raises:
    ConfigError: naming the first offending key and how to fix it.
  """
  cfg = ml_collections.ConfigDict(cfg.to_dict())  # unlocked copy; caller's stays as given
  for axis, size in zip(MESH_AXES, resolve_mesh_shape(cfg.mesh, num_devices)):
    cfg.mesh[axis] = size
  _check_mesh(cfg.mesh, cfg.model.family, num_devices)
  _check_model(cfg)
  _check_attention(cfg.model, cfg.data)
  _check_pipeline(cfg)
  _check_fp8(cfg.model, cfg.mesh.pipe > 1 or cfg.pipeline.microbatches > 1)
  train_checks.validate_train(cfg, _read_only_defaults().train)
  train_checks.validate_checkpoint(cfg)
  if cfg.hardware.peak_flops_per_device < 0:
    raise ConfigError('hardware.peak_flops_per_device', 'must be >= 0 (0 = look up)')
  _check_rules(cfg.sharding.logical_axis_rules)
  check_sequence(cfg.mesh, cfg.model)
  _check_fsdp(cfg)
  registry.validate(
    cfg.model,
    _read_only_defaults().model,
    cfg.mesh,
    cfg.sharding.logical_axis_rules,
    pipelined=cfg.mesh.pipe > 1 or cfg.pipeline.microbatches > 1,
  )
  _check_layer_split(cfg)
  return cfg


def _check_mesh(mesh, family: str, num_devices: int) -> None:
  """The mesh group, its axes already resolved: dcn factors, device order, the expert axis."""
  for axis in MESH_AXES:
    dcn = mesh[f'dcn_{axis}']
    if not isinstance(dcn, int) or dcn <= 0 or mesh[axis] % dcn:
      raise ConfigError(
        f'mesh.dcn_{axis}',
        f'must be a positive divisor of mesh.{axis}={mesh[axis]}, got {dcn!r}',
      )
  _check_device_order(mesh, num_devices)
  _check_expert(mesh, family)


def _check_model(cfg) -> None:
  """The model group's shapes and dtypes against the tensor degree and the data it reads."""
  for key in ('num_layers', 'd_model', 'num_heads', 'd_ff', 'vocab_size', 'seq_len'):
    checks.positive_int(f'model.{key}', cfg.model[key])
  m = cfg.model
  checks.non_negative_int('model.head_dim', m.head_dim, zero='d_model / num_heads')
  if not m.head_dim and m.d_model % m.num_heads:
    raise ConfigError(
      'model.num_heads',
      f'must divide model.d_model={m.d_model}, got {m.num_heads}; or set model.head_dim',
    )
  check_tensor_split(m, cfg.mesh.tensor)
  chunk = m.loss_chunk
  if (
    not isinstance(chunk, int)
    or isinstance(chunk, bool)
    or chunk < 0
    or (chunk and m.seq_len % chunk)
  ):
    raise ConfigError(
      'model.loss_chunk',
      f'must be 0 (all at once) or a divisor of model.seq_len={m.seq_len}, got {chunk!r}',
    )
  used = m.vocab_used
  if not isinstance(used, int) or isinstance(used, bool) or not 0 <= used <= m.vocab_size:
    raise ConfigError(
      'model.vocab_used',
      f'must be in [0, model.vocab_size={m.vocab_size}] (0 = every id used; the ids from it '
      f'on are padding), got {used!r}',
    )
  checks.boolean('model.scan_layers', m.scan_layers)
  data_checks.validate(cfg.data)
  if m.vocab_size < 256 and cfg.data.source in data_checks.BYTE_SOURCES:
    raise ConfigError('model.vocab_size', f'the byte-level corpus needs 256, got {m.vocab_size}')
  for key, choices in (
    ('dtype', DTYPES),
    ('param_dtype', DTYPES),
    ('remat', REMAT_POLICIES),
    ('attention', ATTENTION_IMPLS),
    ('fp8', FP8_RECIPES),
  ):
    if m[key] == 'float16' and key in ('dtype', 'param_dtype'):
      # float16's range needs dynamic loss scaling, which triax does not do:
      # gradients would underflow to zero without a word.
      raise ConfigError(
        f'model.{key}', 'float16 needs loss scaling, which triax does not do; use bfloat16'
      )
    retired = RETIRED_REMATS.get(m[key]) if key == 'remat' and isinstance(m[key], str) else None
    if retired:
      raise ConfigError('model.remat', f'{m[key]!r} {retired}')
    checks.one_of(f'model.{key}', m[key], choices)


def remat_policies(m) -> tuple[str, ...]:
  """The remat policies model config `m` composes with (what the planner's
  search tries): under model.fp8 every one but dots, whose policy cannot see
  an FP8 matmul (a custom_vjp) to keep its product."""
  return tuple(r for r in REMAT_POLICIES if m.fp8 == 'none' or r != 'dots')


def _check_fp8(m, pipelined: bool) -> None:
  """What model.fp8 composes with: `remat_policies`; its metrics need, for
  now, no pipeline executor (mesh.pipe or pipeline.microbatches > 1), whose
  step does not carry them; model.fp8_amax_history only with delayed,
  model.fp8_grad only with FP8."""
  if m.remat not in remat_policies(m):
    # An FP8 matmul is a custom_vjp (its backward's E5M2 GEMMs), whose
    # product the dots policy cannot see to keep: the layer would be recomputed whole.
    raise ConfigError(
      'model.fp8',
      f"{m.fp8} hides each matmul from model.remat=dots's policy; use remat none, "
      'attention or full',
    )
  checks.positive_int('model.fp8_amax_history', m.fp8_amax_history)
  given = _read_only_defaults().model
  checks.one_of('model.fp8_grad', m.fp8_grad, FP8_GRADS)
  if m.fp8 == 'none' and m.fp8_grad != given.fp8_grad:
    raise ConfigError(
      'model.fp8_grad',
      "is the FP8 backward's format, read only with model.fp8; set model.fp8=tensorwise, "
      'rowwise or delayed, or drop it',
    )
  default = given.fp8_amax_history
  if m.fp8 != 'delayed' and m.fp8_amax_history != default:
    raise ConfigError(
      'model.fp8_amax_history',
      f'is read only with model.fp8=delayed (model.fp8={m.fp8}); set model.fp8=delayed or drop it',
    )
  checks.boolean('model.fp8_metrics', m.fp8_metrics)
  if m.fp8_metrics and m.fp8 == 'none':
    raise ConfigError(
      'model.fp8_metrics',
      'reports FP8 matmuls; set model.fp8=tensorwise, rowwise or delayed, or drop it',
    )
  if m.fp8_metrics and pipelined:
    raise ConfigError(
      'model.fp8_metrics',
      'is not carried by the pipeline executor; drop it or use mesh.pipe=1 and '
      'pipeline.microbatches=1',
    )


def head_dim(m) -> int:
  """Each attention head's width of config.model `m` (model.head_dim, or d_model / num_heads)."""
  return m.head_dim or m.d_model // m.num_heads


def _check_attention(m, data) -> None:
  """What the attention kernel chosen accepts (cudnn's and splash's rules)."""
  if m.attention == 'cudnn' and data.mask_documents:
    raise ConfigError(
      'model.attention',
      'cudnn takes no document mask here (data.mask_documents=true); use xla',
    )
  if m.mtp_depth and data.mask_documents:
    # The head, where MTP runs, has no document ids: its block would attend
    # across packed documents and its deeper targets cross their ends.
    raise ConfigError(
      'model.mtp_depth',
      'MTP takes no document mask (data.mask_documents=true); set model.mtp_depth=0 or '
      'data.mask_documents=false',
    )
  if m.attention == 'cudnn':
    # What JAX's cuDNN attention accepts; found here rather than at compile time.
    if m.dtype != 'bfloat16':
      raise ConfigError(
        'model.attention', f'cudnn needs model.dtype=bfloat16, got {m.dtype}; or use xla'
      )
    if head_dim(m) % 8:
      raise ConfigError(
        'model.attention', f'cudnn needs a head_dim multiple of 8, got {head_dim(m)}; or use xla'
      )

  _check_splash(m)


def _check_pipeline(cfg) -> None:
  """The pipeline group: the schedule's own rules (its builder's)."""
  p, pipe = cfg.pipeline, cfg.mesh.pipe
  checks.one_of('pipeline.schedule', p.schedule, SCHEDULES, what='schedule')
  checks.positive_int('pipeline.microbatches', cfg.pipeline.microbatches)
  checks.positive_int('pipeline.virtual_stages', cfg.pipeline.virtual_stages)
  checks.one_of('pipeline.edge_grads', p.edge_grads, EDGE_GRADS)
  checks.boolean('pipeline.scatter_gather', p.scatter_gather)
  checks.one_of('pipeline.tick_packing', p.tick_packing, PACKINGS)
  v = p.virtual_stages
  # The builder knows each schedule's rules (v allowed, m a multiple of p, ...);
  # a schedule file is read, checked against p, m, v and lowered here.
  schedule = sched.from_config(p, pipe, p.microbatches, v)
  _check_offload_stash(p, pipe, schedule)
  _check_fuse_overlaps(p, schedule)


def _check_fuse_overlaps(p, schedule) -> None:
  """Fusing needs pairs that fuse, and a stash on the device."""
  checks.boolean('pipeline.fuse_overlaps', p.fuse_overlaps)
  if not p.fuse_overlaps:
    return
  sched.check_fusable(schedule)
  if p.offload_stash:
    raise ConfigError(
      'pipeline.fuse_overlaps',
      'a fused tick reads one residual set and writes another, and pipeline.offload_stash copies '
      'one a tick; set one of them to false',
    )


def _check_offload_stash(p, pipe: int, schedule) -> None:
  """The stash is the executor's, which runs with stages or micro-batches."""
  checks.boolean('pipeline.offload_stash', p.offload_stash)
  if not p.offload_stash:
    return
  if pipe == 1 and p.microbatches == 1:
    raise ConfigError(
      'pipeline.offload_stash',
      'only the pipeline executor has a stash: set mesh.pipe or pipeline.microbatches > 1, '
      'or set it to false',
    )
  if schedule.partner is not None:
    raise ConfigError(
      'pipeline.offload_stash',
      f'{schedule.name} moves residual sets between stages to balance them, which offloading '
      'replaces; choose another schedule (1f1b, zb_h1, ...) or set it to false',
    )


def _check_layer_split(cfg) -> None:
  """The layers' cut into the pipeline's chunks, whole stack entries each (the
  family's: a MoE family's groups of model.moe_every blocks), so after the model's checks."""
  # Here, not at the top: the layout converts stacks with JAX, and importing
  # this module loads none (validate loads the family's model anyway).
  from triax.pipeline.layout import StackLayout

  p = cfg.pipeline
  spec = registry.spec_from_config(cfg.model)
  entry = spec.layers_per_entry
  StackLayout.build(
    spec.stacked_layers,
    cfg.mesh.pipe,
    p.virtual_stages,
    tuple(p.layers_per_stage or ()),
    per_entry=entry,
    held_out=cfg.model.num_layers - spec.stacked_layers,
  )


def _check_splash(m) -> None:
  checks.boolean('model.splash_interpret', m.splash_interpret)
  if m.splash_interpret and m.attention != 'splash':
    raise ConfigError(
      'model.splash_interpret', f'interprets the splash kernel, but model.attention={m.attention}'
    )
  if m.attention == 'splash' and m.seq_len % 128:
    raise ConfigError(
      'model.attention',
      f'splash tiles the sequence by multiples of 128 (the TPU lanes, interpreted too); '
      f'model.seq_len={m.seq_len} is not one (use xla)',
    )


def check_platform(cfg, platform: str) -> None:
  """What the configured kernels need of the devices' platform (cpu, gpu, tpu).

  Raises:
    ConfigError('model.attention', ...): a kernel this platform cannot run.
  """
  m = cfg.model
  if m.attention == 'splash' and platform != 'tpu' and not m.splash_interpret:
    raise ConfigError(
      'model.attention',
      f'splash is a TPU kernel and the devices are {platform}; use xla (or cudnn on a GPU), '
      'or model.splash_interpret=true to run it interpreted (slow: tests)',
    )
  if m.attention == 'cudnn' and platform != 'gpu':
    raise ConfigError(
      'model.attention', f'cudnn is a GPU kernel and the devices are {platform}; use xla'
    )


def _check_fsdp(cfg) -> None:
  """mesh.fsdp: a flag whose rule ('embed' over data, sharding.resolve_rules)
  no given rule contradicts, on a d_model the data axis divides."""
  checks.boolean('mesh.fsdp', cfg.mesh.fsdp)
  if not cfg.mesh.fsdp:
    return
  embed = dict(tuple(r) for r in cfg.sharding.logical_axis_rules).get('embed')
  if embed not in (None, 'data'):
    raise ConfigError(
      'mesh.fsdp',
      f"shards 'embed' over data, but sharding.logical_axis_rules maps it to {embed!r}; "
      'remove that rule or mesh.fsdp',
    )
  if cfg.model.d_model % cfg.mesh.data:
    raise ConfigError(
      'mesh.fsdp',
      f'model.d_model={cfg.model.d_model} does not divide by mesh.data={cfg.mesh.data}',
    )


def check_tensor_split(m, tensor: int) -> None:
  """What mesh.tensor needs of the model (validate's check, and the planner's
  for every tensor degree it tries): heads, d_ff and the vocabulary split
  over it. A family's own rules (llama's K/V heads) are its validate's."""
  if m.num_heads % tensor:
    raise ConfigError(
      'model.num_heads',
      f'{m.num_heads} heads cannot be split over mesh.tensor={tensor}; '
      'use a multiple of mesh.tensor',
    )
  if m.d_ff % tensor:
    raise ConfigError('model.d_ff', f'{m.d_ff} is not divisible by mesh.tensor={tensor}')
  if m.vocab_size % tensor:
    raise ConfigError(
      'model.vocab_size',
      f'{m.vocab_size} is not divisible by mesh.tensor={tensor} '
      '(the embedding and output layer are vocabulary-parallel)',
    )


def check_sequence(mesh, m) -> None:
  """mesh.context, mesh.sequence_parallel and model.context_attention against the
  model: what splitting the sequence needs of it (validate's check, and the
  planner's for every context degree and SP choice it tries)."""
  c, t = mesh.context, mesh.tensor
  checks.one_of('model.context_attention', m.context_attention, CONTEXT_ATTENTION, what='kind')
  if c > 1 and m.seq_len % (2 * c):
    # Causal load balancing: rank i holds chunks i and 2c-1-i of 2c equal chunks.
    raise ConfigError(
      'mesh.context',
      f'{c} context ranks need model.seq_len={m.seq_len} to split into {2 * c} equal chunks '
      f'(causal load balancing); use a context degree c with seq_len % (2c) == 0',
    )
  if c > 1 and m.attention != 'xla':
    kind = 'ring attention' if m.context_attention == 'ring' else 'the all-gather kind'
    raise ConfigError(
      'model.attention',
      f'{m.attention} cannot serve mesh.context={c} ({kind} masks by load-balanced '
      'positions, which only the xla path takes); use model.attention=xla',
    )
  checks.boolean('mesh.sequence_parallel', mesh.sequence_parallel)
  if mesh.sequence_parallel and t == 1:
    raise ConfigError(
      'mesh.sequence_parallel',
      'splits the sequence over `tensor`, and mesh.tensor=1; set mesh.tensor > 1 or remove it',
    )
  if mesh.sequence_parallel and m.seq_len % (c * t):
    raise ConfigError(
      'mesh.sequence_parallel',
      f'model.seq_len={m.seq_len} does not split over context*tensor={c * t} ranks; '
      'use a seq_len divisible by it, or remove mesh.sequence_parallel',
    )


def _check_rules(rules: Sequence) -> None:
  for rule in rules:
    axes = rule[1] if len(rule) == 2 and isinstance(rule[1], (tuple, list)) else (rule[-1],)
    if len(rule) != 2 or not all(a is None or a in MESH_AXES for a in axes):
      raise ConfigError(
        'sharding.logical_axis_rules',
        f'rule {tuple(rule)!r} must map a logical axis to one of {", ".join(MESH_AXES)}, '
        'a tuple of them, or None',
      )
