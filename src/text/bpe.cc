#include "text/bpe.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "text/unicode.h"

namespace tq {
namespace {

constexpr char32_t kSmallCharLimit = 0x800;

bool heap_after(const BpeModel::Scratch::Entry& a, const BpeModel::Scratch::Entry& b) {
  // std heap functions keep the "largest" on top: the largest is the lowest cost, then the leftmost.
  if (a.cost != b.cost) return a.cost > b.cost;
  return a.left > b.left;
}

}  // namespace

BpeModel::BpeModel(std::vector<std::string> vocab, const Options& options)
    : vocab_(std::move(vocab)), options_(options) {
  ids_.build(vocab_);
  small_char_ids_.assign(kSmallCharLimit, -1);
  std::string s;
  for (char32_t cp = 0; cp < kSmallCharLimit; ++cp) {
    s.clear();
    append_utf8(s, cp);
    small_char_ids_[cp] = find(s);
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    byte_ids_[b] = find(name);
  }
  TQ_CHECK(options_.unk_id < static_cast<int32_t>(vocab_.size()), "BPE: unknown-token id ", options_.unk_id,
           " is outside the vocabulary of ", vocab_.size());
}

int32_t BpeModel::find(std::string_view text) const {
  return ids_.find(text);
}

void BpeModel::set_merges(const std::vector<std::pair<std::string, std::string>>& merges) {
  merges_.reserve(merges.size());
  std::string joined;
  for (size_t i = 0; i < merges.size(); ++i) {
    const auto& [a, b] = merges[i];
    const int32_t ia = find(a), ib = find(b);
    TQ_CHECK(ia >= 0 && ib >= 0, "merge ", i, " ('", a, "' '", b, "'): '", ia < 0 ? a : b,
             "' is not in the vocabulary");
    joined = a + b;
    const int32_t id = find(joined);
    TQ_CHECK(id >= 0, "merge ", i, " ('", a, "' '", b, "'): the result '", joined, "' is not in the vocabulary");
    // A repeated merge keeps its last rank, as HF's map built from the list does.
    merges_.put(ia, ib, {static_cast<int32_t>(i), id}, true);
  }
  build_bigrams();
}

void BpeModel::set_merges_from_vocab_ranks() {
  merges_.reserve(vocab_.size() * 2);
  for (size_t id = 0; id < vocab_.size(); ++id) {
    const std::string& t = vocab_[id];
    // Every split of the token into two tokens is a merge that produces it, ranked by the token's id.
    size_t cut = utf8_sequence_length(static_cast<unsigned char>(t.empty() ? 0 : t[0]));
    while (cut < t.size()) {
      const int32_t a = find(std::string_view(t).substr(0, cut));
      const int32_t b = find(std::string_view(t).substr(cut));
      if (a >= 0 && b >= 0) merges_.put(a, b, {static_cast<int32_t>(id), static_cast<int32_t>(id)}, false);
      cut += utf8_sequence_length(static_cast<unsigned char>(t[cut]));
    }
  }
  build_bigrams();
}

void BpeModel::set_scores(std::vector<float> scores, std::vector<uint8_t> mergeable) {
  TQ_CHECK(scores.size() == vocab_.size() && mergeable.size() == vocab_.size(), "BPE: ", scores.size(),
           " scores and ", mergeable.size(), " piece kinds for a vocabulary of ", vocab_.size());
  scores_ = std::move(scores);
  mergeable_ids_.build(vocab_, &mergeable);
  // Characters resolve through the mergeable pieces only.
  std::string s;
  for (char32_t cp = 0; cp < kSmallCharLimit; ++cp) {
    s.clear();
    append_utf8(s, cp);
    small_char_ids_[cp] = mergeable_ids_.find(s);
  }
  build_bigrams();
}

void BpeModel::build_bigrams() {
  bigrams_.clear();
  const bool by_score = options_.priority == Priority::piece_score;
  for (const std::string& t : vocab_) {
    if (t.empty() || (by_score && mergeable_ids_.find(t) < 0)) continue;
    char32_t prev = 0;
    bool have_prev = false;
    size_t i = 0;
    while (i < t.size()) {
      const Utf8Step step = decode_utf8_step(std::string_view(t).substr(i));
      if (have_prev) bigrams_.insert((static_cast<uint64_t>(prev) << 32) | step.cp);
      prev = step.cp;
      have_prev = true;
      i += step.bytes;
    }
  }
}

void BpeModel::split_chunks(std::string_view word, std::vector<std::string_view>& chunks) const {
  chunks.clear();
  if (options_.ignore_merges || word.empty()) {
    chunks.push_back(word);
    return;
  }
  size_t chunk_start = 0, i = 0;
  char32_t prev = 0;
  bool prev_known = false;
  while (i < word.size()) {
    const Utf8Step step = decode_utf8_step(word.substr(i));
    // Only cut between characters that are tokens themselves: the others become byte or unknown tokens,
    // whose vocabulary strings are not their text, so the bigram argument says nothing about them.
    const bool known = step.valid && char_id(word.substr(i, step.bytes), step.cp) >= 0;
    if (prev_known && known && !bigrams_.count((static_cast<uint64_t>(prev) << 32) | step.cp)) {
      chunks.push_back(word.substr(chunk_start, i - chunk_start));
      chunk_start = i;
    }
    prev = step.cp;
    prev_known = known;
    i += step.bytes;
  }
  chunks.push_back(word.substr(chunk_start));
}

int32_t BpeModel::char_id(std::string_view ch, char32_t cp) const {
  if (cp < kSmallCharLimit) return small_char_ids_[cp];
  if (options_.priority == Priority::piece_score) {
    return mergeable_ids_.find(ch);
  }
  return find(ch);
}

void BpeModel::build_symbols(std::string_view word, std::vector<Symbol>& symbols) const {
  symbols.clear();
  const bool by_score = options_.priority == Priority::piece_score;
  bool pending_unk = false;  // the last symbol is an unknown token that later unknowns may join
  size_t i = 0;
  while (i < word.size()) {
    const Utf8Step step = decode_utf8_step(word.substr(i));
    const std::string_view ch = word.substr(i, step.bytes);
    const uint32_t start = static_cast<uint32_t>(i);
    i += step.bytes;
    const int32_t id = step.valid ? char_id(ch, step.cp) : find(ch);
    if (id >= 0 || by_score) {
      // piece_score keeps unknown characters as symbols (id -1): they never merge and are resolved at the end.
      symbols.push_back({id, start, step.bytes, 0, 0});
      pending_unk = false;
      continue;
    }
    if (options_.byte_fallback) {
      bool all = true;
      for (char c : ch) all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        for (uint32_t k = 0; k < step.bytes; ++k)
          symbols.push_back({byte_ids_[static_cast<unsigned char>(ch[k])], start + k, 1, 0, 0});
        pending_unk = false;
        continue;
      }
    }
    if (options_.unk_id < 0) continue;  // dropped, as HF does without an unknown token
    if (pending_unk && options_.fuse_unk) {
      symbols.back().len += step.bytes;
    } else {
      symbols.push_back({options_.unk_id, start, step.bytes, 0, 0});
      pending_unk = true;
    }
  }
  for (size_t k = 0; k < symbols.size(); ++k) {
    symbols[k].prev = static_cast<int32_t>(k) - 1;
    symbols[k].next = k + 1 < symbols.size() ? static_cast<int32_t>(k + 1) : -1;
  }
}

bool BpeModel::candidate(std::string_view word, const Symbol& a, const Symbol& b, Candidate& c) const {
  if (options_.priority == Priority::merge_rank) {
    if (a.id < 0 || b.id < 0) return false;
    const MergeTable::Merge* m = merges_.find(a.id, b.id);
    if (!m) return false;
    c = {static_cast<double>(m->rank), m->new_id};
    return true;
  }
  if (a.id < 0 || b.id < 0) return false;
  const int32_t id = mergeable_ids_.find(word.substr(a.start, a.len + b.len));
  if (id < 0) return false;
  c = {-static_cast<double>(scores_[static_cast<size_t>(id)]), id};
  return true;
}

void BpeModel::emit(std::string_view word, const std::vector<Symbol>& symbols, std::vector<int32_t>& out) const {
  for (int32_t k = symbols.empty() ? -1 : 0; k >= 0; k = symbols[static_cast<size_t>(k)].next) {
    const Symbol& s = symbols[static_cast<size_t>(k)];
    if (s.id >= 0) {
      out.push_back(s.id);
      continue;
    }
    // piece_score: a character the vocabulary lacks.
    const std::string_view bytes = word.substr(s.start, s.len);
    bool all = options_.byte_fallback;
    for (char c : bytes) all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
    if (all) {
      for (char c : bytes) out.push_back(byte_ids_[static_cast<unsigned char>(c)]);
    } else if (options_.unk_id >= 0) {
      out.push_back(options_.unk_id);
    }
  }
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out, Scratch& scratch) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (const int32_t id = find(word); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  std::vector<Symbol>& sym = scratch.symbols;
  build_symbols(word, sym);
  auto& heap = scratch.heap;
  heap.clear();
  Candidate c;
  auto push_pair = [&](int32_t left) {
    const int32_t right = sym[static_cast<size_t>(left)].next;
    if (right < 0) return;
    const Symbol& a = sym[static_cast<size_t>(left)];
    const Symbol& b = sym[static_cast<size_t>(right)];
    if (!candidate(word, a, b, c)) return;
    heap.push_back({c.cost, static_cast<uint32_t>(left), a.len, b.len, c.new_id});
    std::push_heap(heap.begin(), heap.end(), heap_after);
  };
  for (size_t k = 0; k + 1 < sym.size(); ++k) push_pair(static_cast<int32_t>(k));
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), heap_after);
    const Scratch::Entry top = heap.back();
    heap.pop_back();
    Symbol& left = sym[top.left];
    // A stale entry: the left symbol or its right neighbour changed since it was queued (a symbol only
    // changes by growing, so equal lengths mean the same pair).
    if (left.len != top.left_len || left.next < 0) continue;
    Symbol& right = sym[static_cast<size_t>(left.next)];
    if (right.len != top.right_len) continue;
    left.id = top.new_id;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = static_cast<int32_t>(top.left);
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(static_cast<int32_t>(top.left));
  }
  emit(word, sym, out);
}

void BpeModel::encode_word_reference(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (const int32_t id = find(word); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  std::vector<Symbol> sym;
  build_symbols(word, sym);
  // The live symbols as a plain array; merge the best adjacent pair until none is left.
  std::vector<Symbol> live = sym;
  while (true) {
    size_t best = live.size();
    Candidate best_c{0, -1}, c;
    for (size_t k = 0; k + 1 < live.size(); ++k) {
      if (!candidate(word, live[k], live[k + 1], c)) continue;
      if (best == live.size() || c.cost < best_c.cost) best = k, best_c = c;
    }
    if (best == live.size()) break;
    live[best].id = best_c.new_id;
    live[best].len += live[best + 1].len;
    live.erase(live.begin() + static_cast<ptrdiff_t>(best) + 1);
  }
  for (size_t k = 0; k < live.size(); ++k) {
    live[k].prev = static_cast<int32_t>(k) - 1;
    live[k].next = k + 1 < live.size() ? static_cast<int32_t>(k + 1) : -1;
  }
  emit(word, live, out);
}

}  // namespace tq
