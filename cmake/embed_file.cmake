# Turns a file into a C++ source that holds its bytes (run as `cmake -DIN=... -DOUT=... -DNAME=... -P`).
# The source defines `extern const unsigned char NAME[]` (the bytes, then a NUL) and
# `extern const unsigned long NAME_size` in namespace tq::embedded.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" hex_len)
math(EXPR size "${hex_len} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
# Line breaks every 32 bytes keep the generated file readable by editors and compilers alike.
string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){32})" "\\1\n" bytes "${bytes}")
file(WRITE "${OUT}.tmp"
  "// Generated from ${IN} by cmake/embed_file.cmake: do not edit.\n"
  "namespace tq::embedded {\n"
  "extern const unsigned char ${NAME}[];\n"
  "extern const unsigned long ${NAME}_size;\n"
  "const unsigned char ${NAME}[] = {\n${bytes}0x00};\n"
  "const unsigned long ${NAME}_size = ${size};\n"
  "}  // namespace tq::embedded\n")
file(RENAME "${OUT}.tmp" "${OUT}")
