"""logprob-parity core: score the same token ids with HF transformers and vLLM, compare, store.

Importing this package imports neither torch nor vLLM; backends load lazily in worker processes.
"""

__version__ = "0.1.0"
