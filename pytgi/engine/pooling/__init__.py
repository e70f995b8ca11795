"""Embeddings and scores: an encoder's engine over whole prompts, and a causal LM's pooling head on the
paged engine."""
