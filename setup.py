"""The compiled parts of kvtier; everything else is declared in pyproject.toml. What each kernel does and why it is
compiled: src/kvtier/kernels/ops.py, the one face its callers use."""

from setuptools import Extension, setup

AVX2_MODULE = "src/kvtier/kernels/avx2_module.h"  # the module set-up the AVX2 + FMA kernels share

setup(ext_modules=[
    Extension("kvtier.kernels._crc32c_units", ["src/kvtier/kernels/crc32c_units.c"]),
    Extension("kvtier.kernels._sketch_scores", ["src/kvtier/kernels/sketch_scores.c"]),
    Extension("kvtier.kernels._hot_dots", ["src/kvtier/kernels/hot_dots.c"], depends=[AVX2_MODULE]),
    Extension("kvtier.kernels._chosen_values", ["src/kvtier/kernels/chosen_values.c"], depends=[AVX2_MODULE]),
    Extension("kvtier.kernels._candidate_dots", ["src/kvtier/kernels/candidate_dots.c"], depends=[AVX2_MODULE]),
    Extension("kvtier.kernels._top_share", ["src/kvtier/kernels/top_share.c"]),
    Extension("kvtier.kernels._hit_table", ["src/kvtier/kernels/hit_table.c"]),
    Extension("kvtier.kernels._summed_query", ["src/kvtier/kernels/summed_query.c"], depends=[AVX2_MODULE]),
])
