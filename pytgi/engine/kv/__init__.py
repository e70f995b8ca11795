"""The KV cache's books: the blocks and the prefix cache over them, the prefix cache's disk tier, and
how many KV slots fit beside the weights."""
