"""turboquant.codec: the same bytes as the C++ codec (tq_codec_dump runs it on the same vectors), any
leading shape, float16 input, and ValueError naming bad shapes, dtypes and parameters."""

import subprocess

import numpy as np
import pytest

from conftest import tool

from turboquant import codec


def cxx(tmp_path, *args):
    subprocess.run([tool("tq_codec_dump"), *map(str, args)], check=True, capture_output=True)


def vectors(rows, dim, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    x[:, ::17] *= 8  # outlier channels, as real keys have
    return x


CASES = [
    # dim, bits, group, seed, grid, fit, rotation, codebook, layout
    (128, 8, 64, 42, "uniform", "norm_correction", "dim", "gaussian", "planes"),
    (128, 3, 64, 42, "lloyd_absmax", "norm_correction", "dim", "gaussian", "planes"),
    (128, 4, 32, 7, "lloyd_max", "plain", "group", "sphere", "planes"),
    (96, 2, 32, 1234, "lloyd_max", "least_squares", "dim", "gaussian", "stream"),
    (64, 5, 64, 3, "lloyd_absmax", "plain", "none", "gaussian", "planes"),
]


@pytest.mark.parametrize("dim,bits,group,seed,grid,fit,rotation,cb,layout", CASES)
def test_quantize_is_the_cxx_codec_bit_for_bit(tmp_path, dim, bits, group, seed, grid, fit, rotation, cb, layout):
    x = vectors(40, dim, seed)
    x.tofile(tmp_path / "x.f32")
    cxx(tmp_path, "tq", tmp_path / "x.f32", dim, bits, group, seed, grid, fit, rotation, cb, layout, tmp_path / "out")
    kw = dict(group_size=group, seed=seed, grid=grid, fit=fit, rotation=rotation, codebook=cb, layout=layout)
    codes, scales = codec.quantize(x.reshape(4, 10, dim), bits, **kw)
    assert codes.dtype == np.uint8 and scales.dtype == np.float16
    assert codes.shape[:2] == (4, 10) and scales.shape == (4, 10, dim // group)
    want_codes = np.fromfile(tmp_path / "out.codes", dtype=np.uint8).reshape(40, -1)
    want_scales = np.fromfile(tmp_path / "out.scales", dtype=np.uint16).reshape(40, -1)
    assert np.array_equal(codes.reshape(40, -1), want_codes)
    assert np.array_equal(scales.reshape(40, -1).view(np.uint16), want_scales)
    back = codec.dequantize(codes, scales, bits, **kw)
    assert back.shape == (4, 10, dim) and back.dtype == np.float32
    want_back = np.fromfile(tmp_path / "out.deq", dtype=np.float32).reshape(40, dim)
    assert np.array_equal(back.reshape(40, dim).view(np.uint32), want_back.view(np.uint32))


def test_defaults_are_the_projects_and_reconstruct_closely():
    x = vectors(64, 128)
    q = codec.Quantizer(128, 3)
    codes, scales = codec.quantize(x, 3)
    assert np.array_equal(codes, q.quantize(x)[0])
    assert q.code_bytes == 48 and q.groups == 2 and q.bits_per_value == pytest.approx(3.25)
    back = codec.dequantize(codes, scales, 3)
    rel = np.sum((back - x) ** 2) / np.sum(x**2)
    assert rel < 0.05, rel  # 3-bit Lloyd levels: about 3% relative error
    rel8 = np.sum((codec.dequantize(*codec.quantize(x, 8), 8) - x) ** 2) / np.sum(x**2)
    assert rel8 < 1e-4


def test_float16_and_strided_input_give_the_same_codes():
    x = vectors(16, 128).astype(np.float16)
    c16, s16 = codec.quantize(x, 4)
    c32, s32 = codec.quantize(x.astype(np.float32), 4)
    assert np.array_equal(c16, c32) and np.array_equal(s16.view(np.uint16), s32.view(np.uint16))
    wide = vectors(16, 256)
    strided = wide[:, ::2]
    assert not strided.flags.c_contiguous
    assert np.array_equal(codec.quantize(strided, 4)[0], codec.quantize(np.ascontiguousarray(strided), 4)[0])
    # One vector: a 1-d array works too.
    assert codec.quantize(wide[0], 4)[0].shape == (codec.Quantizer(256, 4).code_bytes,)


def test_out_arrays_are_written_in_place():
    x = vectors(8, 128)
    q = codec.Quantizer(128, 4)
    codes = np.zeros((8, q.code_bytes), np.uint8)
    scales = np.zeros((8, q.groups), np.float16)
    got = q.quantize(x, out=(codes, scales))
    assert got[0] is codes and got[1] is scales
    assert np.array_equal(codes, q.quantize(x)[0])
    back = np.zeros_like(x)
    assert q.dequantize(codes, scales, out=back) is back and np.array_equal(back, q.dequantize(codes, scales))
    with pytest.raises(ValueError, match=r"out must have shape \(8, 128\), got \(8, 64\)"):
        q.dequantize(codes, scales, out=np.zeros((8, 64), np.float32))
    with pytest.raises(ValueError, match="out codes must be uint8"):
        q.quantize(x, out=(scales, scales))


def test_rotated_domain_calls_match_the_rotation():
    x = vectors(8, 128)
    q = codec.Quantizer(128, 4, seed=9)
    r = codec.Rotation(128, seed=9)
    codes, scales = q.quantize(x)
    y_hat = q.dequantize_rotated(codes, scales)
    np.testing.assert_allclose(r.inverse(y_hat), q.dequantize(codes, scales), atol=1e-5)
    codes2, _ = q.quantize_rotated(r.forward(x))
    assert np.array_equal(codes, codes2)
    assert len(q.levels) == 16 and len(q.thresholds) == 15 and np.all(np.diff(q.levels) > 0)


@pytest.mark.parametrize("dim,seed,block", [(128, 42, 0), (96, 5, 0), (2880, 1, 0), (256, 3, 64)])
def test_rotation_is_the_cxx_rotation(tmp_path, dim, seed, block):
    x = vectors(6, dim, seed)
    x.tofile(tmp_path / "x.f32")
    cxx(tmp_path, "rotation", tmp_path / "x.f32", dim, seed, block, tmp_path / "out")
    r = codec.Rotation(dim, seed=seed, block=block)
    fwd = r.forward(x.reshape(2, 3, dim))
    assert fwd.shape == (2, 3, dim)
    assert np.array_equal(fwd.reshape(6, dim), np.fromfile(tmp_path / "out.fwd", dtype=np.float32).reshape(6, dim))
    assert np.array_equal(r.inverse(x), np.fromfile(tmp_path / "out.inv", dtype=np.float32).reshape(6, dim))
    np.testing.assert_allclose(r.inverse(fwd), x.reshape(2, 3, dim), rtol=1e-5, atol=1e-4)
    assert r.signs.shape == (dim,) and set(np.unique(r.signs)) <= {-1.0, 1.0}
    assert np.array_equal(x, vectors(6, dim, seed))  # the input is not modified


@pytest.mark.parametrize("fmt,block_bytes", [("q8_0", 34), ("q4_0", 18)])
def test_absmax_blocks_are_the_cxx_blocks(tmp_path, fmt, block_bytes):
    x = vectors(8, 96)
    x.tofile(tmp_path / "x.f32")
    cxx(tmp_path, fmt, tmp_path / "x.f32", tmp_path / "out")
    quantize = getattr(codec, "quantize_" + fmt)
    dequantize = getattr(codec, "dequantize_" + fmt)
    blocks = quantize(x)
    assert blocks.shape == (8, 3, block_bytes)
    assert np.array_equal(blocks.reshape(-1), np.fromfile(tmp_path / "out.blocks", dtype=np.uint8))
    back = dequantize(blocks)
    assert back.shape == (8, 96)
    assert np.array_equal(back.reshape(-1), np.fromfile(tmp_path / "out.deq", dtype=np.float32))


def test_codebooks():
    cb = codec.codebook(3)
    assert cb.bits == 3 and cb.distribution == "gaussian" and len(cb.centroids) == 8 and len(cb.boundaries) == 7
    assert np.all(np.diff(cb.centroids) > 0) and cb.mse == pytest.approx(0.03454, rel=1e-3)  # Lloyd-Max, N(0,1), 3 bits
    sphere = codec.codebook(2, "sphere", 64)
    assert sphere.distribution == "sphere" and sphere.dim == 64
    assert codec.absmax_codebook(4, 64).centroids.max() <= 1.0
    assert isinstance(codec.simd_target(), str)


def test_bad_input_is_a_value_error_naming_it():
    x = vectors(4, 128)
    with pytest.raises(ValueError, match="float32 or float16, got float64"):
        codec.quantize(x.astype(np.float64), 4)
    with pytest.raises(ValueError, match="float32 or float16, got int32"):
        codec.quantize(np.zeros((2, 128), np.int32), 4)
    with pytest.raises(ValueError, match="must be a NumPy array"):
        codec.quantize([1.0, 2.0], 4)
    with pytest.raises(ValueError, match="0-d"):
        codec.quantize(np.array(1.0, np.float32), 4)
    with pytest.raises(ValueError, match="bits must be 1..8, got 9"):
        codec.quantize(x, 9)
    with pytest.raises(ValueError, match="group"):
        codec.quantize(vectors(2, 96), 4, group_size=64)
    with pytest.raises(ValueError, match="unknown grid 'nope'"):
        codec.quantize(x, 4, grid="nope")
    codes, scales = codec.quantize(x, 4)
    with pytest.raises(ValueError, match="codes must have 64 bytes on the last axis"):
        codec.dequantize(codes[:, :10], scales, 4)
    with pytest.raises(ValueError, match="scales must be float16, got float32"):
        codec.dequantize(codes, scales.astype(np.float32), 4)
    with pytest.raises(ValueError, match="same leading shape"):
        codec.dequantize(codes[:2], scales, 4)
    with pytest.raises(ValueError, match="128 values on the last axis"):
        codec.Quantizer(128, 4).quantize(vectors(2, 64))
    with pytest.raises(ValueError, match="rotation's dimension"):
        codec.Rotation(128).forward(vectors(2, 64))
    with pytest.raises(ValueError, match="multiple of 32, got 40"):
        codec.quantize_q8_0(vectors(2, 40))
    with pytest.raises(ValueError, match=r"\(\.\.\., n / 32, 18\)"):
        codec.dequantize_q4_0(np.zeros((2, 34), np.uint8))


def test_docstrings_everywhere():
    for name in codec.__all__:
        obj = getattr(codec, name)
        assert obj.__doc__ and obj.__doc__.strip(), name


def test_the_gil_is_released_while_quantizing():
    import threading
    import time

    x = np.random.default_rng(1).standard_normal((1 << 16, 128)).astype(np.float32)  # 32 MiB: a long call
    q = codec.Quantizer(128, 4)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (q.quantize(x), done.set()))
    ticks = 0
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.0005)
    worker.join()
    assert ticks > 10  # Python ran during the one C++ call
