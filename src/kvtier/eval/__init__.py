"""Evaluation suite (issue 4): result records shared by `kvtier bench accuracy`, `bench latency` and `bench report`."""
