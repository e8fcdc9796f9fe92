// libFuzzer target: a Hugging Face tokenizer.json (with, after the separator line, an optional
// tokenizer_config.json beside it) loaded as load_tokenizer_dir does: model.vocab and merges, added
// tokens, normalizer, pre-tokenizer (its regexes compiled), decoder, post-processor, the special ids of
// tokenizer_config.json; then what a run does with it: texts encoded (added tokens, byte fallback, special
// tokens on and off), decoded, and streamed through StreamDecoder token by token.
// Seeds: the tokenizer.json files of models/demo and /work/shared, trimmed to a few hundred tokens.
#include "fuzz/fuzz_util.h"
#include "text/tokenizer.h"

namespace {

void exercise(const tq::Tokenizer& tok) {
  static const char* const kTexts[] = {"Once upon a time, there was a little cat.", " \n\n  tabs\tand  spaces ",
                                       "<s>[INST] <|im_start|>user\nhi<|im_end|> </s>", "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac 123456 \xf0\x9f\x98\x80",
                                       "\xff\xfe invalid \xc3"};
  for (const char* text : kTexts) {
    for (bool special : {true, false}) {
      tq::EncodeOptions o;
      o.add_special_tokens = special;
      o.parse_special = special;
      const std::vector<int32_t> ids = tok.encode(text, o);
      (void)tok.decode(ids, special);
      tq::StreamDecoder stream(tok, special);
      for (int32_t id : ids) (void)stream.push(id);
      (void)stream.flush();
    }
  }
  // Ids around the vocabulary's edges: decode ignores unknown ones, the lookups give empty strings.
  for (int32_t id : {-1, 0, 1, tok.vocab_size() - 1, tok.vocab_size(), tok.bos_id(), tok.eos_id()}) {
    (void)tok.token_to_piece(id);
    (void)tok.id_to_token(id);
    (void)tok.is_special(id);
  }
  (void)tok.describe();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string_view> parts = tq::fuzz::split_parts(data, size, 2);
  tq::fuzz::write_scratch("tokenizer.json", parts[0]);
  if (parts[1].empty())
    tq::fuzz::remove_scratch("tokenizer_config.json");
  else
    tq::fuzz::write_scratch("tokenizer_config.json", parts[1]);
  tq::fuzz::refused([&] { exercise(*tq::load_tokenizer_dir(tq::fuzz::scratch_dir())); });
  return 0;
}
