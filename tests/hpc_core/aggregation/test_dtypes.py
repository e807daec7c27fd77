"""Raw safetensors bytes <-> float32, bfloat16 included (numpy has no bfloat16)."""

from __future__ import annotations

import numpy as np

from hpc_core.aggregation.dtypes import decode, encode


def test_bfloat16_round_trips_and_rounds_half_to_even() -> None:
    exact = np.array([0.0, 1.0, -2.5, 3.140625, 65280.0, np.inf], dtype=np.float32)
    raw = np.frombuffer(encode(exact, "BF16"), dtype=np.uint8)
    assert raw.view("<u2").tolist()[:3] == [0x0000, 0x3F80, 0xC020]
    np.testing.assert_array_equal(decode(raw, "BF16"), exact)
    # 1 + 2**-8 lies halfway between 1 and 1 + 2**-7: to even (1); 1 + 3 * 2**-8: up.
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8, np.nan], dtype=np.float32)
    back = decode(np.frombuffer(encode(halfway, "BF16"), dtype=np.uint8), "BF16")
    assert back[0] == 1.0 and back[1] == 1 + 2**-6 and np.isnan(back[2])


def test_float_dtypes_decode_little_endian() -> None:
    values = np.array([1.5, -0.25, 1e-3], dtype=np.float32)
    for name, dtype in (("F16", "<f2"), ("F32", "<f4"), ("F64", "<f8")):
        raw = np.frombuffer(values.astype(dtype).tobytes(), dtype=np.uint8)
        np.testing.assert_allclose(decode(raw, name), values, rtol=1e-3)
        assert encode(decode(raw, name), name) == raw.tobytes()
