#include "codec/packing.h"

#include <cassert>
#include <cstring>

#include "core/error.h"

namespace tq {

void check_bits(int bits) { TQ_CHECK(bits >= 1 && bits <= 8, "bits must be in 1..8, got ", bits); }

namespace {

// 8 codes of b bits <-> b bytes (the stream is byte-aligned every 8 codes).
inline void pack8(const uint8_t* c, int bits, uint8_t* out) {
  uint64_t word = 0;
  for (int i = 0; i < 8; ++i) word |= static_cast<uint64_t>(c[i]) << (i * bits);
  for (int i = 0; i < bits; ++i) out[i] = static_cast<uint8_t>(word >> (8 * i));
}
inline void unpack8(const uint8_t* in, int bits, uint8_t* c) {
  uint64_t word = 0;
  for (int i = 0; i < bits; ++i) word |= static_cast<uint64_t>(in[i]) << (8 * i);
  const uint64_t mask = (1u << bits) - 1;
  for (int i = 0; i < 8; ++i) c[i] = static_cast<uint8_t>((word >> (i * bits)) & mask);
}

}  // namespace

void pack_dense(const uint8_t* codes, size_t count, int bits, uint8_t* out) {
  assert(bits >= 1 && bits <= 8);
  if (bits == 8) {
    std::memcpy(out, codes, count);
    return;
  }
  const size_t whole = count / 8;
  for (size_t g = 0; g < whole; ++g) pack8(codes + 8 * g, bits, out + static_cast<size_t>(bits) * g);
  const size_t rest = count - 8 * whole;
  if (rest) {
    uint8_t tail[8] = {0};
    std::memcpy(tail, codes + 8 * whole, rest);
    uint8_t bytes[8];
    pack8(tail, bits, bytes);
    std::memcpy(out + static_cast<size_t>(bits) * whole, bytes, packed_bytes(count, bits) - bits * whole);
  }
}

void unpack_dense(const uint8_t* packed, size_t count, int bits, uint8_t* codes) {
  assert(bits >= 1 && bits <= 8);
  if (bits == 8) {
    std::memcpy(codes, packed, count);
    return;
  }
  const size_t whole = count / 8;
  for (size_t g = 0; g < whole; ++g) unpack8(packed + static_cast<size_t>(bits) * g, bits, codes + 8 * g);
  const size_t rest = count - 8 * whole;
  if (rest) {
    uint8_t bytes[8] = {0};
    std::memcpy(bytes, packed + static_cast<size_t>(bits) * whole, packed_bytes(count, bits) - bits * whole);
    uint8_t tail[8];
    unpack8(bytes, bits, tail);
    std::memcpy(codes + 8 * whole, tail, rest);
  }
}

void pack_planes(const uint8_t* codes, size_t count, int bits, uint8_t* out) {
  assert(count % 8 == 0);
  if (bits == 8) {
    std::memcpy(out, codes, count);
    return;
  }
  const size_t plane = count / 8;
  for (size_t q = 0; q < plane; ++q) {
    const uint8_t* c = codes + 8 * q;
    for (int k = 0; k < bits; ++k) {
      uint8_t byte = 0;
      for (int i = 0; i < 8; ++i) byte = static_cast<uint8_t>(byte | (((c[i] >> k) & 1u) << i));
      out[k * plane + q] = byte;
    }
  }
}

void unpack_planes(const uint8_t* packed, size_t count, int bits, uint8_t* codes) {
  assert(count % 8 == 0);
  if (bits == 8) {
    std::memcpy(codes, packed, count);
    return;
  }
  const size_t plane = count / 8;
  for (size_t q = 0; q < plane; ++q) {
    uint8_t* c = codes + 8 * q;
    for (int i = 0; i < 8; ++i) c[i] = 0;
    for (int k = 0; k < bits; ++k) {
      const uint8_t byte = packed[k * plane + q];
      for (int i = 0; i < 8; ++i) c[i] = static_cast<uint8_t>(c[i] | (((byte >> i) & 1u) << k));
    }
  }
}

void pack_codes(PackLayout layout, const uint8_t* codes, size_t count, int bits, uint8_t* out) {
  if (layout == PackLayout::planes) {
    pack_planes(codes, count, bits, out);
  } else {
    pack_dense(codes, count, bits, out);
  }
}

void unpack_codes(PackLayout layout, const uint8_t* packed, size_t count, int bits, uint8_t* codes) {
  if (layout == PackLayout::planes) {
    unpack_planes(packed, count, bits, codes);
  } else {
    unpack_dense(packed, count, bits, codes);
  }
}

void pack_words(const uint8_t* codes, size_t count, int bits, uint32_t* out) {
  const size_t per = static_cast<size_t>(indices_per_word(bits));
  const size_t words = packed_words(count, bits);
  for (size_t w = 0; w < words; ++w) {
    uint32_t word = 0;
    for (size_t i = 0; i < per && w * per + i < count; ++i) {
      word |= static_cast<uint32_t>(codes[w * per + i]) << (i * bits);
    }
    out[w] = word;
  }
}

void unpack_words(const uint32_t* packed, size_t count, int bits, uint8_t* codes) {
  const size_t per = static_cast<size_t>(indices_per_word(bits));
  const uint32_t mask = (1u << bits) - 1;
  for (size_t i = 0; i < count; ++i) {
    codes[i] = static_cast<uint8_t>((packed[i / per] >> ((i % per) * bits)) & mask);
  }
}

}  // namespace tq
