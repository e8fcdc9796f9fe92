#include "serve/chat_page.h"

namespace tq::embedded {
extern const unsigned char chat_page[];  // generated (cmake/embed_file.cmake): the bytes and a NUL
extern const unsigned long chat_page_size;
}  // namespace tq::embedded

namespace tq::serve {

std::string_view chat_page() {
  return {reinterpret_cast<const char*>(tq::embedded::chat_page), static_cast<size_t>(tq::embedded::chat_page_size)};
}

}  // namespace tq::serve
