"""The TurboQuant codec on NumPy arrays (src/codec, the same code the KV cache runs).

Vectors lie along the last axis; any leading shape is kept. Input is float32 or float16 (a C-contiguous
float32 array is read in place, float16 and strided arrays are converted once). Bad shapes, dtypes and
parameters raise ValueError naming the problem. The GIL is released while the C++ code runs.

    codes, scales = quantize(x, bits=3)          # uint8 [..., code_bytes], float16 [..., dim / 64]
    x_hat = dequantize(codes, scales, bits=3)    # float32 [..., dim]
    y = Rotation(128, seed=42).forward(x)        # the randomized Hadamard rotation
    blocks = quantize_q8_0(x)                    # llama.cpp's q8_0 blocks, uint8 [..., n / 32, 34]
"""

from ._turboquant.codec import (
    Codebook,
    Quantizer,
    Rotation,
    absmax_codebook,
    codebook,
    dequantize,
    dequantize_q4_0,
    dequantize_q8_0,
    quantize,
    quantize_q4_0,
    quantize_q8_0,
    simd_target,
)

__all__ = [
    "Codebook",
    "Quantizer",
    "Rotation",
    "absmax_codebook",
    "codebook",
    "dequantize",
    "dequantize_q4_0",
    "dequantize_q8_0",
    "quantize",
    "quantize_q4_0",
    "quantize_q8_0",
    "simd_target",
]
