"""Checkpoints in other frameworks' formats: Hugging Face's names and configs for
the llama and mixtral families (hf_llama) and the deepseek family
(hf_deepseek), and a workdir's import and export (hf_checkpoint, behind
`python -m triax convert`)."""
