"""Integrations of infllm-cupy's ops into other frameworks (docs/integrations.md).

`infllm_cupy.integrations.transformers`: an attention function for Hugging Face transformers'
`attn_implementation` switch and a KV cache that keeps InfLLM-v2's compressed keys.
`infllm_cupy.integrations.minicpm4`: a MiniCPM4-style sparse attention layer written against the
`infllm_v2` compat API, and a small Llama-like causal LM built from it.
Both import transformers lazily: `pip install -e ".[hf]"`.
"""
