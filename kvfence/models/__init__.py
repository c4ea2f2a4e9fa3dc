"""Model implementations that read and write a paged KV pool, and what they need to run.

What lives where: `forward_batch` (what one forward reads: positions, slots, masks; built by the engine's runner),
`llama`, `deepseek` (with `mla`, `dsa`, `moe`), `attention`, `linear`, `native_kernels` (+ .cpp: the CPU kernels),
`loader`/`registry` (Hugging Face directories to our classes), `llama_config` (a Llama-family config.json read
without transformers), `heap` (malloc_trim), `tokenizer`, `default` (the built-in default model and presets),
`native_build` (the first build's cost, in words). What it does not know: scheduling, requests, serving.
"""
