// The chat page served at /, embedded at build time from tools/serve/web/index.html.
#pragma once

#include <string_view>

namespace tq::serve {

std::string_view chat_page();

}  // namespace tq::serve
