"""pdserve: prefill/decode disaggregated serving around vLLM."""
