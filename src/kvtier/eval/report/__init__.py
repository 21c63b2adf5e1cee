"""`bench report`: REPORT.md and its plots from whatever result files exist."""
