"""The compiled parts of kvtier; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

AVX2_MODULE = "src/kvtier/kernels/avx2_module.h"  # the module set-up the AVX2 + FMA kernels share

setup(ext_modules=[
    # crc32c of every page of a read in one call: a Python call per page cost more than the crc (storage/checksum.py)
    Extension("kvtier.kernels._crc32c_units", ["src/kvtier/kernels/crc32c_units.c"]),
    # sketch scores straight from the codes: dequantizing first in numpy cost the scorer ~4x more (sparse/cold/sketch.py)
    Extension("kvtier.kernels._sketch_scores", ["src/kvtier/kernels/sketch_scores.c"]),
    # the hot pool's q.k from its bfloat16 keys in one pass: torch converted the whole pool first (sparse/hot/hot_pool.py)
    Extension("kvtier.kernels._hot_dots", ["src/kvtier/kernels/hot_dots.c"], depends=[AVX2_MODULE]),
    # the decode step's softmax and weighted sums in one call, the chosen values read in place: copying them out first
    # cost more than the product, and torch's dozen small ops per layer more than their arithmetic (sparse/selection.py)
    Extension("kvtier.kernels._chosen_values", ["src/kvtier/kernels/chosen_values.c"], depends=[AVX2_MODULE]),
    # the cold candidates' q.k and importance read where their records landed: four torch ops cost more (sparse/selection.py)
    Extension("kvtier.kernels._candidate_dots", ["src/kvtier/kernels/candidate_dots.c"], depends=[AVX2_MODULE]),
    # each row's top scores as ascending indices: numpy's argpartition plus a sort cost more (kernels/top_share.py)
    Extension("kvtier.kernels._top_share", ["src/kvtier/kernels/top_share.c"]),
    # the hit table's step and the migration check's idle scan: numpy's passes over every chosen and hot token cost
    # more per layer than the top-alpha's selection (sparse/hot/hit_table.py)
    Extension("kvtier.kernels._hit_table", ["src/kvtier/kernels/hit_table.c"]),
    # the lookahead's predicted query in one call: five torch ops cost more than the product (sparse/lookahead.py)
    Extension("kvtier.kernels._summed_query", ["src/kvtier/kernels/summed_query.c"], depends=[AVX2_MODULE]),
])
