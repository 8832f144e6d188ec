"""``LazyArray[...]`` reads boxes into a compact buffer and lets NumPy index it
(readers/lazy.py ``_selection``): for any index NumPy takes, the result equals NumPy's on the
whole array, and the boxes read stay inside the array and cover no more than the selection's
runs (property tests, no storage)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zarrckpt.readers.lazy import _selection, normalize_index


@st.composite
def cases(draw):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9))
    index = draw(hnp.basic_indices(shape, allow_newaxis=True, allow_ellipsis=True)
                 | hnp.integer_array_indices(shape, result_shape=hnp.array_shapes(max_dims=2, max_side=4))
                 if all(shape) and shape else hnp.basic_indices(shape, allow_newaxis=True))
    unit = tuple(draw(st.integers(1, 4)) for _ in shape)
    return shape, index, unit


@settings(max_examples=400, deadline=None)
@given(cases())
def test_selection_gives_numpys_result(case):
    shape, index, unit = case
    a = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    norm = normalize_index(index, shape)
    boxes, extent, local = _selection(norm, shape, unit)
    buf = np.full(extent, -1, dtype=np.int64)
    for box, dst in boxes:
        assert all(0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape))
        region = a[tuple(slice(lo, hi) for lo, hi in box)]
        if dst:
            buf[dst] = region
        else:
            buf[...] = region
    np.testing.assert_array_equal(buf[local], a[index])
