"""The one compiled part of kvtier; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

# crc32c of every page of a read in one call: a Python call per page cost more than the crc (storage/checksum.py)
setup(ext_modules=[Extension("kvtier.storage._crc32c_units", ["src/kvtier/storage/crc32c_units.c"])])
