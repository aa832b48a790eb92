"""Engine adapters: record a real serving engine's steps with a `tracekit.Recorder`.

- `engine_adapters.transformers_cb.instrument_transformers`: Hugging Face transformers'
  continuous batching (``ContinuousBatchingManager``);
- `engine_adapters.vllm_v1.instrument_vllm`: vLLM V1's engine core, single-process mode;
- `engine_adapters.tiny_model.build_tiny_llama`: a tiny random Llama both engines load,
  for tests, examples and the overhead bench.

Each adapter is installed on a live engine and used as a context manager; leaving it puts
every original method back. The engines are optional: install them with the `adapters`
extra (see docs/adapters.md). Importing this package imports neither engine.
"""
