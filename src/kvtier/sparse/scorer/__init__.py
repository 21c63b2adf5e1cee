"""The storage-side scorer: a process next to the cold files that scores sketches and reads candidates, and the host's
client of it. Everything here but `client.py` imports no torch (the process starts fast)."""
