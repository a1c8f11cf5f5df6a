"""The shared core of the decoder families (llama3, qwen3, deepseek_v3): one concern per module.

  * `norms.py` RMSNorm; `rope.py` the RoPE table (optionally YaRN-scaled) and its two pair layouts (Meta's
    interleaved, HF's rotate_half);
  * `attention.py` grouped-query attention (optional per-head q/k norm, the KV-cache path); `mla.py` multi-head
    latent attention (DeepSeek-V3's, with the latent KV cache);
  * `feed_forward.py` SwiGLU; `moe.py` the mixture of experts (softmax or DeepSeek-V3's sigmoid group-limited
    router, expert stacks, shared experts, grouped GEMM, auxiliary loss, selection bias, the dispatcher expert
    parallelism replaces);
  * `block.py` the pre-norm decoder block; `decoder.py` the model (embedding, blocks, norm, optionally tied head,
    init, parameter and FLOP counts);
  * `tensor_parallel.py` the TP plan, read off the model's modules; `memory.py` the activation estimate;
    `hf_adapter.py` the Hugging Face state-dict adapter's skeleton and names; `spec.py` the ModelSpec plumbing.

A family keeps its ModelArgs, flavors, block builder and what truly differs (e.g. Llama 3's q/k permutation for
Hugging Face). See titan_dmuon/models/README.md.
"""
