"""Speed: decoding, prefill, MoE and attention layers, training steps, the command line, llama.cpp."""
