// libFuzzer target: the vocabulary formats other than tokenizer.json (text/tokenizer.h), chosen by the
// input's first byte:
//   'v'  vocab.json, separator, merges.txt, separator, tokenizer_config.json (load_vocab_merges)
//   'l'  llama2.c tokenizer.bin (load_llama2c_tokenizer)
//   's'  SentencePiece tokenizer.model, protobuf (load_sentencepiece_model)
//   't'  a tiktoken file, with GPT-2's pattern and two special tokens (load_tiktoken)
// then texts encoded, decoded and streamed as a run does. Seeds: gpt2's vocab.json + merges.txt,
// tok512.bin, Llama 2's tokenizer.model and r50k_base.tiktoken from /work/shared, trimmed.
#include "fuzz/fuzz_util.h"
#include "text/tokenizer.h"

namespace {

void exercise(const tq::Tokenizer& tok) {
  static const char* const kTexts[] = {"Once upon a time, there was a little cat.", " \n\n  tabs\tand  spaces ",
                                       "<|endoftext|> <s> caf\xc3\xa9 \xe6\x97\xa5 123456", "\xff\xfe invalid \xc3"};
  for (const char* text : kTexts) {
    const std::vector<int32_t> ids = tok.encode(text);
    (void)tok.decode(ids);
    tq::StreamDecoder stream(tok);
    for (int32_t id : ids) (void)stream.push(id);
    (void)stream.flush();
  }
  for (int32_t id : {-1, 0, tok.vocab_size() - 1, tok.vocab_size()}) (void)tok.token_to_piece(id);
  (void)tok.describe();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const char kind = static_cast<char>(data[0]);
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  tq::fuzz::refused([&] {
    std::unique_ptr<tq::Tokenizer> tok;
    if (kind == 'v') {
      const std::vector<std::string_view> parts = tq::fuzz::split_parts(data + 1, size - 1, 3);
      tok = tq::load_vocab_merges(tq::fuzz::write_scratch("vocab.json", parts[0]), tq::fuzz::write_scratch("merges.txt", parts[1]),
                                  parts[2].empty() ? std::string() : tq::fuzz::write_scratch("tokenizer_config.json", parts[2]));
    } else if (kind == 'l') {
      tok = tq::load_llama2c_tokenizer(tq::fuzz::write_scratch("tokenizer.bin", rest));
    } else if (kind == 's') {
      tok = tq::load_sentencepiece_model(tq::fuzz::write_scratch("tokenizer.model", rest));
    } else if (kind == 't') {
      const std::vector<tq::TiktokenSpecial> specials = {{"<|endoftext|>", 300}, {"<|fim|>", 301}};
      tok = tq::load_tiktoken(tq::fuzz::write_scratch("vocab.tiktoken", rest), "", specials, -1, 300, false);
    } else {
      return;
    }
    exercise(*tok);
  });
  return 0;
}
