"""Accuracy of the KV modes: needle grids, perplexity and the attention mass a mode's selection kept."""
