"""One key given as a ``str`` instead of a list is refused, not taken a character at a time."""

import numpy as np
import pytest

from sglang_flatcake.keys import key_digests
from sglang_flatcake.store import FlatCakeStore

from tests.support import blocks_for, chain


def test_key_digests_refuses_one_str_or_bytes():
    key = chain(1)[0]
    with pytest.raises(TypeError, match=rf"keys='{key}' is not allowed: expected a list of "
                                        "keys, not one str"):
        key_digests(key)
    with pytest.raises(TypeError, match="not one bytes"):
        key_digests(b"abc")
    assert key_digests([key]).shape == (1, 2)                  # the list of one still works


def test_the_store_refuses_one_str_key_and_keeps_nothing(tmp_path, layout, config):
    keys = chain(3)
    with FlatCakeStore(tmp_path / "s", layout, config) as st:
        st.put(keys, blocks_for(layout, keys))
        with pytest.raises(TypeError, match="one str"):
            st.exists(keys[0])                                 # was: 64 one-character keys
        with pytest.raises(TypeError, match="one str"):
            st.locate(keys[1])
        with pytest.raises(TypeError, match="one str"):
            st.get(keys[0], np.empty((64, layout.block_bytes), np.uint8))
        other = chain(1, "b")[0]
        with pytest.raises(TypeError, match="one str"):     # 64 blocks for 64 "keys"
            st.put(other, blocks_for(layout, [other] * 64))
        assert st.exists(keys) == 3 and st.exists([other]) == 0
