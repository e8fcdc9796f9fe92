// Bit packing of b-bit indices (1 <= b <= 8).
//
// Dense layout (the KV cache): an LSB-first bit stream. Index i occupies stream bits
// [i*b, i*b + b); stream bit t is bit (t % 8) of byte t / 8. No bit is wasted:
// 3 bits -> 8 indices in 3 bytes. packed_bytes(n, b) = ceil(n * b / 8).
//
// Plane layout (the KV cache; SIMD-friendly): for n indices (n a multiple of 8) of b bits, b planes
// of n/8 bytes; bit i of plane k (bit i % 8 of byte k * n/8 + i/8) is bit k of index i. No bit is
// wasted either: 3 bits -> 8 indices in 3 bytes (one byte of each plane). At 8 bits the planes would
// be plain bytes, so 8-bit indices are stored as bytes.
//
// Word layout (the reference system's weight files): uint32 words, least significant index first,
// floor(32 / b) indices per word; the top 32 mod b bits of each word are zero.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tq {

inline size_t packed_bytes(size_t count, int bits) { return (count * static_cast<size_t>(bits) + 7) / 8; }
inline int indices_per_word(int bits) { return 32 / bits; }
inline size_t packed_words(size_t count, int bits) {
  const size_t per = static_cast<size_t>(indices_per_word(bits));
  return (count + per - 1) / per;
}

// codes[i] < 2^bits is required (checked in debug builds only: this is a hot path).
void pack_dense(const uint8_t* codes, size_t count, int bits, uint8_t* out);
void unpack_dense(const uint8_t* packed, size_t count, int bits, uint8_t* codes);

// n must be a multiple of 8. packed size = packed_bytes(n, bits).
void pack_planes(const uint8_t* codes, size_t count, int bits, uint8_t* out);
void unpack_planes(const uint8_t* packed, size_t count, int bits, uint8_t* codes);

enum class PackLayout { stream, planes };
void pack_codes(PackLayout layout, const uint8_t* codes, size_t count, int bits, uint8_t* out);
void unpack_codes(PackLayout layout, const uint8_t* packed, size_t count, int bits, uint8_t* codes);

void pack_words(const uint8_t* codes, size_t count, int bits, uint32_t* out);
void unpack_words(const uint32_t* packed, size_t count, int bits, uint8_t* codes);

// Throws tq::Error unless 1 <= bits <= 8.
void check_bits(int bits);

}  // namespace tq
