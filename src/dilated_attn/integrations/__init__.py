"""Integrations with other libraries. Each lives in a submodule of its own and imports its library only when that
submodule is imported (`import dilated_attn` imports none of them):

* `dilated_attn.integrations.transformers`: an attention implementation for Hugging Face transformers 5.x
  (`register()`, then `attn_implementation="dilated_attention"`), docs/modules.md, "Hugging Face transformers".
"""
