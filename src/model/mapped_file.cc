#include "model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace tq {

namespace {

std::string describe_errno(int err) {
  switch (err) {
    case ENOENT: return "no such file";
    case EACCES: return "permission denied";
    case ENOTDIR: return "a component of the path is not a directory";
    case EISDIR: return "is a directory";
    case ENAMETOOLONG: return "path too long";
    case ELOOP: return "too many symbolic links";
    default: return std::strerror(err);
  }
}

// Closes the descriptor on every exit path of open().
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

MappedFile MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    fail("cannot open '", path, "': ", describe_errno(err));
  }
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    fail("cannot stat '", path, "': ", describe_errno(err));
  }
  TQ_CHECK(!S_ISDIR(st.st_mode), "cannot read '", path, "': it is a directory, not a file");
  TQ_CHECK(S_ISREG(st.st_mode), "cannot read '", path, "': not a regular file");
  TQ_CHECK(st.st_size > 0, "'", path, "' is empty (0 bytes)");

  const size_t size = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    fail("cannot memory-map '", path, "' (", size, " bytes): ", describe_errno(err));
  }
  MappedFile f;
  f.path_ = path;
  f.mapping_ = p;
  f.data_ = static_cast<const uint8_t*>(p);
  f.size_ = size;
  return f;
}

MappedFile MappedFile::from_bytes(std::string name, std::vector<uint8_t> bytes) {
  TQ_CHECK(!bytes.empty(), "'", name, "' is empty (0 bytes)");
  MappedFile f;
  f.path_ = std::move(name);
  f.owned_ = std::move(bytes);
  f.data_ = f.owned_.data();
  f.size_ = f.owned_.size();
  return f;
}

MappedFile MappedFile::borrow(std::string name, const void* data, size_t size) {
  TQ_CHECK(data != nullptr && size > 0, "'", name, "' is empty (0 bytes)");
  MappedFile f;
  f.path_ = std::move(name);
  f.data_ = static_cast<const uint8_t*>(data);
  f.size_ = size;
  return f;
}

MappedFile::MappedFile(MappedFile&& other) noexcept { *this = std::move(other); }

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    size_ = std::exchange(other.size_, 0);
    // Moving a std::vector keeps its heap buffer, so data_ stays valid for from_bytes files too.
    owned_ = std::move(other.owned_);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

MappedFile::~MappedFile() { release(); }

void MappedFile::release() noexcept {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
  mapping_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  owned_.clear();
}

}  // namespace tq
