"""From logits to tokens: which rows a step needs and the draws per output position, the vectorised
sampler, the grammars' masks, the watermark."""
