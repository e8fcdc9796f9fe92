#include "codec/rotation.h"

#include <cmath>
#include <map>
#include <mutex>

#include "codec/kernels.h"
#include "core/error.h"
#include "core/rng.h"

namespace tq {
namespace {

int quadratic_character(int a, int q) {
  a = ((a % q) + q) % q;
  if (a == 0) return 0;
  for (int x = 1; x < q; ++x) {
    if ((x * x) % q == a) return 1;
  }
  return -1;
}

// Paley I (q prime, q = 3 mod 4): H = I + S, S = [[0, 1^T], [-1, Q]], Q_ij = chi(j - i).
std::vector<int8_t> paley_one(int q) {
  const int n = q + 1;
  std::vector<int> s(n * n, 0);
  for (int j = 1; j < n; ++j) {
    s[0 * n + j] = 1;
    s[j * n + 0] = -1;
  }
  for (int i = 0; i < q; ++i)
    for (int j = 0; j < q; ++j) s[(i + 1) * n + (j + 1)] = quadratic_character(j - i, q);
  std::vector<int8_t> h(n * n);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) h[i * n + j] = static_cast<int8_t>(s[i * n + j] + (i == j ? 1 : 0));
  return h;
}

// Paley II (q prime, q = 1 mod 4): C = [[0, 1^T], [1, Q]] (symmetric conference matrix),
// H = C (x) [[1, 1], [1, -1]] + I (x) [[1, -1], [-1, -1]], of order 2(q + 1).
std::vector<int8_t> paley_two(int q) {
  const int c_n = q + 1, n = 2 * c_n;
  std::vector<int> c(c_n * c_n, 0);
  for (int j = 1; j < c_n; ++j) c[j] = c[j * c_n] = 1;
  for (int i = 0; i < q; ++i)
    for (int j = 0; j < q; ++j) c[(i + 1) * c_n + (j + 1)] = quadratic_character(j - i, q);
  const int a[2][2] = {{1, 1}, {1, -1}}, b[2][2] = {{1, -1}, {-1, -1}};
  std::vector<int8_t> h(n * n);
  for (int i = 0; i < c_n; ++i)
    for (int j = 0; j < c_n; ++j)
      for (int r = 0; r < 2; ++r)
        for (int t = 0; t < 2; ++t)
          h[(2 * i + r) * n + 2 * j + t] =
              static_cast<int8_t>(c[i * c_n + j] * a[r][t] + (i == j ? b[r][t] : 0));
  return h;
}

void check_hadamard(const std::vector<int8_t>& h, int n) {
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      int dot = 0;
      for (int k = 0; k < n; ++k) dot += h[i * n + k] * h[j * n + k];
      if (dot != (i == j ? n : 0)) fail("internal error: order-", n, " Hadamard construction is wrong");
    }
}

// Sloane's tables (neilsloane.com/hadamard: had.12, and the orders 20 and 28 as MLX's
// mlx/backend/common/hadamard.h holds them), one line per row, '+' = +1, '-' = -1.
constexpr const char* kSloane12 =
    "+-++++++++++" "--+-+-+-+-+-" "+++-++----++" "+---+--+-++-" "+++++-++----" "+-+---+--+-+"
    "++--+++-++--" "+--++---+--+" "++----+++-++" "+--+-++---+-" "++++----+++-" "+-+--+-++---";
constexpr const char* kSloane20 =
    "+----+----++--++-++-" "-+----+---+++---+-++" "--+----+---+++-+-+-+" "---+----+---+++++-+-"
    "----+----++--++-++-+" "-+++++-----+--+++--+" "+-+++-+---+-+--+++--" "++-++--+---+-+--+++-"
    "+++-+---+---+-+--+++" "++++-----++--+-+--++" "--++-+-++-+-----++++" "---++-+-++-+---+-+++"
    "+---++-+-+--+--++-++" "++---++-+----+-+++-+" "-++---++-+----+++++-" "-+--+--++-+----+----"
    "+-+-----++-+----+---" "-+-+-+---+--+----+--" "--+-+++------+----+-" "+--+--++------+----+";
constexpr const char* kSloane28 =
    "+------++----++-+--+-+--++--" "-+-----+++-----+-+--+-+--++-" "--+-----+++---+-+-+----+--++"
    "---+-----+++---+-+-+-+--+--+" "----+-----+++---+-+-+++--+--" "-----+-----++++--+-+--++--+-"
    "------++----++-+--+-+--++--+" "--++++-+-------++--+++-+--+-" "---++++-+-----+-++--+-+-+--+"
    "+---+++--+----++-++--+-+-+--" "++---++---+----++-++--+-+-+-" "+++---+----+----++-++--+-+-+"
    "++++--------+-+--++-++--+-+-" "-++++--------+++--++--+--+-+" "-+-++-++--++--+--------++++-"
    "+-+-++--+--++--+--------++++" "-+-+-++--+--++--+----+---+++" "+-+-+-++--+--+---+---++---++"
    "++-+-+-++--+------+--+++---+" "-++-+-+-++--+------+-++++---" "+-++-+---++--+------+-++++--"
    "-++--++-+-++-+++----++------" "+-++--++-+-++-+++-----+-----" "++-++---+-+-++-+++-----+----"
    "-++-++-+-+-+-+--+++-----+---" "--++-++++-+-+----+++-----+--" "+--++-+-++-+-+----+++-----+-"
    "++--++-+-++-+-+----++------+";

std::vector<int8_t> from_signs_text(const char* text, int m) {
  std::vector<int8_t> h(static_cast<size_t>(m) * m);
  for (size_t i = 0; i < h.size(); ++i) {
    if (text[i] != '+' && text[i] != '-') fail("internal error: Sloane Hadamard table of order ", m, " is short");
    h[i] = text[i] == '+' ? 1 : -1;
  }
  if (text[h.size()] != '\0') fail("internal error: Sloane Hadamard table of order ", m, " is long");
  return h;
}

int odd_part(int n, int* power_of_two) {
  int p = 1;
  while (n % 2 == 0) {
    n /= 2;
    p *= 2;
  }
  *power_of_two = p;
  return n;
}

}  // namespace

const std::vector<int8_t>& Rotation::small_hadamard(int m, HadamardFamily family) {
  static std::mutex mutex;
  static std::map<std::pair<int, HadamardFamily>, std::vector<int8_t>> built;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = built.find({m, family});
  if (it != built.end()) return it->second;
  std::vector<int8_t> h;
  const bool sloane = family == HadamardFamily::sloane;
  switch (m) {
    case 1: h = {1}; break;
    case 12: h = sloane ? from_signs_text(kSloane12, 12) : paley_one(11); break;
    case 20: h = sloane ? from_signs_text(kSloane20, 20) : paley_one(19); break;
    case 28: h = sloane ? from_signs_text(kSloane28, 28) : paley_two(13); break;
    default: fail("no Hadamard matrix of order ", m, " (supported: 1, 12, 20, 28 times a power of two)");
  }
  check_hadamard(h, m);
  return built.emplace(std::make_pair(m, family), std::move(h)).first->second;
}

bool Rotation::is_supported_block(int n) {
  if (n < 1) return false;
  int p = 1;
  const int m = odd_part(n, &p);
  // n = m' * 2^k with m' in {1, 12, 20, 28}: the odd part is 1, 3, 5 or 7 with enough twos.
  switch (m) {
    case 1: return true;
    case 3: case 5: case 7: return p >= 4;
    default: return false;
  }
}

int Rotation::largest_supported_block(int dim) {
  TQ_CHECK(dim >= 1, "rotation dimension must be positive, got ", dim);
  for (int n = dim; n >= 1; --n) {
    if (dim % n == 0 && is_supported_block(n)) return n;
  }
  return 1;
}

std::vector<float> rotation_signs(int dim, uint64_t seed) {
  std::vector<float> s(dim);
  for (int i = 0; i < dim; ++i) {
    const uint64_t word = splitmix64_at(seed, static_cast<uint64_t>(i / 64));
    s[i] = ((word >> (i % 64)) & 1u) ? -1.0f : 1.0f;
  }
  return s;
}

Rotation::Rotation(int dim, int block, uint64_t seed) : seed_(seed) {
  TQ_CHECK(dim >= 1, "rotation dimension must be positive, got ", dim);
  const auto signs = rotation_signs(dim, seed);
  signs_.assign(signs.begin(), signs.end());
  init_plan(dim, block, HadamardFamily::paley);
}

Rotation::Rotation(int dim, int block, const float* signs, HadamardFamily family) : seed_(0) {
  TQ_CHECK(dim >= 1, "rotation dimension must be positive, got ", dim);
  TQ_CHECK(signs != nullptr, "a rotation with stored signs needs its ", dim, " signs");
  for (int i = 0; i < dim; ++i)
    TQ_CHECK(signs[i] == 1.0f || signs[i] == -1.0f, "rotation sign ", i, " is ", signs[i], ", not +1 or -1");
  signs_.assign(signs, signs + dim);
  init_plan(dim, block, family);
}

void Rotation::init_plan(int dim, int block, HadamardFamily family) {
  if (block == 0) block = largest_supported_block(dim);
  TQ_CHECK(block >= 1 && dim % block == 0, "rotation block ", block, " does not divide the dimension ", dim);
  TQ_CHECK(is_supported_block(block), "rotation block ", block,
           " is not supported: it must be m * 2^k with m in {1, 12, 20, 28}");
  int p = 1;
  const int odd = odd_part(block, &p);
  const int m = odd == 1 ? 1 : odd * 4;  // 3 -> 12, 5 -> 20, 7 -> 28
  if (odd != 1) p /= 4;
  plan_.dim = dim;
  plan_.block = block;
  plan_.m = m;
  plan_.p = p;
  plan_.inv_sqrt_block = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  plan_.signs = signs_.data();
  plan_.hadamard_m = small_hadamard(m, family).data();
}

void Rotation::forward(float* x, size_t count) const { kernels::rotate_forward(plan_, x, count); }
void Rotation::inverse(float* x, size_t count) const { kernels::rotate_inverse(plan_, x, count); }

namespace scalar {

// In-place unnormalised Walsh-Hadamard transform of length p, stages h = 1, 2, 4, ...
static void fwht(float* x, int p) {
  for (int h = 1; h < p; h *= 2)
    for (int i = 0; i < p; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// y_r = sum_k H[r][k] * chunk_k (or H^T when transpose), chunks of length p, summed in order k.
static void mix_chunks(const RotationPlan& plan, float* x, bool transpose) {
  const int m = plan.m, p = plan.p;
  std::vector<float> out(static_cast<size_t>(m) * p);
  for (int r = 0; r < m; ++r)
    for (int j = 0; j < p; ++j) {
      float acc = 0;
      for (int k = 0; k < m; ++k) {
        const int8_t h = transpose ? plan.hadamard_m[k * m + r] : plan.hadamard_m[r * m + k];
        acc = h > 0 ? acc + x[k * p + j] : acc - x[k * p + j];
      }
      out[r * p + j] = acc;
    }
  std::copy(out.begin(), out.end(), x);
}

void rotate_forward(const RotationPlan& plan, float* x) {
  for (int base = 0; base < plan.dim; base += plan.block) {
    float* blk = x + base;
    for (int i = 0; i < plan.block; ++i) blk[i] *= plan.signs[base + i];
    for (int c = 0; c < plan.m; ++c) fwht(blk + c * plan.p, plan.p);
    if (plan.m > 1) mix_chunks(plan, blk, false);
    for (int i = 0; i < plan.block; ++i) blk[i] *= plan.inv_sqrt_block;
  }
}

void rotate_inverse(const RotationPlan& plan, float* x) {
  for (int base = 0; base < plan.dim; base += plan.block) {
    float* blk = x + base;
    if (plan.m > 1) mix_chunks(plan, blk, true);
    for (int c = 0; c < plan.m; ++c) fwht(blk + c * plan.p, plan.p);
    for (int i = 0; i < plan.block; ++i) blk[i] = blk[i] * plan.inv_sqrt_block * plan.signs[base + i];
  }
}

}  // namespace scalar
}  // namespace tq
