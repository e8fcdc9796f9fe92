// A read-only view of a whole file's bytes: memory-mapped from disk, or held in memory (for files
// embedded in the binary and for tests that build files on the fly).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tq {

class MappedFile {
 public:
  // Maps `path` read-only. The file must not shrink while mapped (reading a page past its new end
  // raises SIGBUS; model files are not rewritten in place, so this is not guarded). Throws tq::Error naming the path when it is missing, unreadable
  // (permission), a directory, empty, or cannot be mapped.
  static MappedFile open(const std::string& path);
  // Takes ownership of `bytes`; `name` stands in for the path in error messages.
  static MappedFile from_bytes(std::string name, std::vector<uint8_t> bytes);
  // Borrows `size` bytes at `data` (e.g. a file linked into the binary); they must outlive the view.
  static MappedFile borrow(std::string name, const void* data, size_t size);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  // The bytes do not move when the MappedFile is moved, so pointers into them stay valid
  // for as long as some MappedFile owns them.
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  bool is_mapped() const { return mapping_ != nullptr; }

 private:
  void release() noexcept;

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;      // mmap result, unmapped on destruction
  std::vector<uint8_t> owned_;   // from_bytes storage
};

}  // namespace tq
