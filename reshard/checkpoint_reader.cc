// CheckpointReader: opening a checkpoint (manifests, completeness, coverage) and reading any
// shard of a tensor from it (checkpoint.h).
#include "reshard/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <atomic>
#include <map>
#include <nlohmann/json.hpp>

#include "base/check.h"
#include "reshard/checkpoint_internal.h"
#include "reshard/crc32c.h"
#include "reshard/strided_copy.h"

#if MORPH_WITH_CUDA
#include "base/cuda_check.h"
#endif

namespace morph {
namespace {

using namespace checkpoint_internal;  // NOLINT
namespace fs = std::filesystem;
using json = nlohmann::json;

// A data file whose size is not its manifest's (Open: any difference; a Read, which maps the
// file: shorter than the manifest).
Status SizeMismatch(const std::string& path, const struct stat& st, uint64_t manifest_bytes) {
  return DataLossError("data file " + path + " has " + std::to_string(st.st_size) +
                       " bytes, its manifest says " + std::to_string(manifest_bytes) +
                       " (truncated or overwritten)");
}

// Bytes [start, stop) of a data file for the loader: the page cache's own pages, mapped
// read-only (no copy into a user buffer first: each byte is read once, by the pass that
// verifies and places it), or, where mapping fails, read into `fallback`. The file's size was
// checked against its manifest when it was opened (a file truncated by another process while
// mapped would raise SIGBUS).
class FileSpan {
 public:
  FileSpan() = default;
  FileSpan(const FileSpan&) = delete;
  FileSpan& operator=(const FileSpan&) = delete;
  ~FileSpan() { Unmap(); }

  Status Load(int fd, const std::string& path, uint64_t start, uint64_t stop,
              std::vector<char>& fallback) {
    Unmap();
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t aligned = start / page * page;
    size_ = static_cast<size_t>(stop - start);
    if (size_ == 0) {
      data_ = fallback.data();
      return Status();
    }
    void* m = ::mmap(nullptr, static_cast<size_t>(stop - aligned), PROT_READ, MAP_SHARED, fd,
                     static_cast<off_t>(aligned));
    if (m != MAP_FAILED) {
      map_ = m;
      map_len_ = static_cast<size_t>(stop - aligned);
      data_ = static_cast<const char*>(m) + (start - aligned);
      return Status();
    }
    fallback.resize(size_);
    size_t got = 0;
    while (got < size_) {
      MORPH_ASSIGN_SYSCALL_OR_RETURN(
          ssize_t r, ::pread(fd, fallback.data() + got, size_ - got, static_cast<off_t>(start + got)),
          "reading " << path);
      if (r == 0) {
        return DataLossError("data file " + path + " ends at byte " + std::to_string(start + got) +
                             " (truncated)");
      }
      got += static_cast<size_t>(r);
    }
    data_ = fallback.data();
    return Status();
  }
  const char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void Unmap() {
    if (map_ != nullptr) ::munmap(map_, map_len_);
    map_ = nullptr;
  }
  void* map_ = nullptr;
  size_t map_len_ = 0;
  const char* data_ = nullptr;
  size_t size_ = 0;
};
StatusOr<Shard> ShardFromJson(const json& j) {
  Shard s;
  std::vector<Interval> dims;
  for (const json& d : j.at("frame")) {
    dims.push_back({d.at(0).get<int64_t>(), d.at(1).get<int64_t>()});
    // A saved frame lies in its tensor's box, from 0; a negative start would also let the
    // interval's size overflow.
    if (dims.back().begin < 0) {
      return DataLossError("a shard's frame starts at " + std::to_string(dims.back().begin));
    }
  }
  s.frame = Box(std::move(dims));
  s.flat_begin = j.at("flat_begin").get<int64_t>();
  s.flat_end = j.at("flat_end").get<int64_t>();
  StatusOr<int64_t> elements = s.frame.NumElements();
  if (!elements.ok()) return DataLossError(elements.status().message());
  const int64_t n = *elements;
  if (s.flat_begin < 0 || s.flat_end > n || s.flat_begin > s.flat_end) {
    return DataLossError("shard " + s.ToString() + " has a flat range outside its frame");
  }
  return s;
}

// Whether `elements` of `element_bytes` each, from byte `offset`, lie within a file of
// `file_bytes`. Every number comes from a manifest, so nothing is added or multiplied that could
// wrap: offset + length near 2^64 must not pass as a small number.
bool PieceFits(uint64_t offset, int64_t elements, int element_bytes, uint64_t file_bytes) {
  if (elements < 0 || element_bytes <= 0 || offset > file_bytes) return false;
  const uint64_t room = file_bytes - offset;
  return static_cast<uint64_t>(elements) <= room / static_cast<uint64_t>(element_bytes);
}

int64_t ElementOffset(const StridedView& v, int64_t linear) {
  int64_t off = v.offset;
  for (int d = static_cast<int>(v.shape.size()) - 1; d >= 0; --d) {
    const size_t i = static_cast<size_t>(d);
    off += (linear % v.shape[i]) * v.strides[i];
    linear /= v.shape[i];
  }
  return off;
}

// One data file as a Read uses it: manifest facts, open descriptors and where its checksums are.
struct BlockSource {
  const std::string& path;
  uint64_t bytes;
  uint64_t block_bytes;
  const std::vector<uint32_t>& inline_crc;  // format 1
  const std::string& crc_path;              // format 2
  int fd;
  int crc_fd;
};

// Block `k` of data file `path` (blocks of `block` bytes, the file `bytes` long) does not match
// its checksum.
Status ChecksumMismatch(const std::string& path, uint64_t k, uint64_t block, uint64_t bytes) {
  return DataLossError("data file " + path + " is corrupted: checksum mismatch in block " +
                       std::to_string(k) + " (bytes " + std::to_string(k * block) + ".." +
                       std::to_string(std::min(bytes, (k + 1) * block)) + ")");
}

// The checksums of blocks [lo, hi): from the manifest (format 1) or read from checksums.bin.
Status LoadChecksums(const BlockSource& f, uint64_t lo, uint64_t hi, std::vector<uint32_t>& out) {
  out.resize(static_cast<size_t>(hi - lo));
  if (f.crc_path.empty()) {
    std::copy(f.inline_crc.begin() + static_cast<ptrdiff_t>(lo),
              f.inline_crc.begin() + static_cast<ptrdiff_t>(hi), out.begin());
    return Status();
  }
  std::vector<unsigned char> raw(out.size() * 4);
  size_t got = 0;
  while (got < raw.size()) {
    MORPH_ASSIGN_SYSCALL_OR_RETURN(
        ssize_t r,
        ::pread(f.crc_fd, raw.data() + got, raw.size() - got, static_cast<off_t>(4 * lo + got)),
        "reading " << f.crc_path);
    if (r == 0) {
      return DataLossError("checksum file " + f.crc_path + " ends at byte " +
                           std::to_string(4 * lo + got) + " (truncated)");
    }
    got += static_cast<size_t>(r);
  }
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = uint32_t{raw[4 * i]} | uint32_t{raw[4 * i + 1]} << 8 |
             uint32_t{raw[4 * i + 2]} << 16 | uint32_t{raw[4 * i + 3]} << 24;
  }
  return Status();
}

// Copies box elements [e0, e1) of a saved piece (at `piece_offset` in the file; `g` the copy of
// the box from the piece into `out`, element order = file order) and verifies every checksum
// block that holds their bytes, and only those, each once. The walk goes row by row and
// collects, per block, the parts that rows need. A block needed whole is verified while it is
// copied (one pass over its bytes, three blocks at a time, its parts scattered to their rows);
// a block needed in part (row edges, rows that skip bytes) is verified alone and its parts are
// copied afterwards. Every 64 KiB of blocks the batch is checked and the deferred copies run
// while their bytes are still in this core's cache. On a checksum mismatch `out` may hold bytes
// of the bad block (kDataLoss: the caller must not use it).
Status CopyVerified(const BlockSource& f, uint64_t piece_offset, const CopyGeometry& g, int es,
                    int64_t e0, int64_t e1, char* out, std::vector<char>& fallback,
                    std::atomic<int64_t>& bytes_read) {
  const uint64_t block = f.block_bytes;
  // Row r's first element: its offset in the piece and in `out` (elements).
  auto row_offsets = [&](int64_t r) {
    int64_t s = g.src_offset, d = g.dst_offset;
    for (int k = g.outer_rank - 1; k >= 0; --k) {
      const int64_t i = r % g.outer_shape[k];
      r /= g.outer_shape[k];
      s += i * g.src_stride[k];
      d += i * g.dst_stride[k];
    }
    return std::pair<int64_t, int64_t>(s, d);
  };
  auto file_byte = [&](int64_t e) {  // of box element e
    return piece_offset +
           static_cast<uint64_t>((row_offsets(e / g.row).first + e % g.row) * es);
  };
  const uint64_t lo = file_byte(e0) / block;
  const uint64_t hi = (file_byte(e1 - 1) + static_cast<uint64_t>(es) + block - 1) / block;
  const uint64_t start = lo * block, stop = std::min(f.bytes, hi * block);
  FileSpan span;
  MORPH_RETURN_IF_ERROR(span.Load(f.fd, f.path, start, stop, fallback));
  std::vector<uint32_t> want;
  MORPH_RETURN_IF_ERROR(LoadChecksums(f, lo, hi, want));

  // The walk's current block: the parts of it that rows need, in file order, as segments
  // (segs[first..]: destination and length; seg_src: where each starts in the span).
  struct OpenBlock {
    uint64_t k = UINT64_MAX;
    uint64_t covered_end = 0;  // file byte after the last part added
    bool gapless = true;       // parts so far are adjacent, starting at the block's start
    size_t first = 0;
  } cur;
  std::vector<CopySegment> segs;
  std::vector<const char*> seg_src;
  struct Fused {
    uint64_t k;
    size_t first, end;  // in segs
  };
  struct Copy {
    const char* src;
    void* dst;
    size_t bytes;
  };
  std::vector<Fused> fused;
  std::vector<uint64_t> alone;  // verified alone; their parts are copied afterwards
  std::vector<Copy> deferred;
  std::vector<const void*> alone_src;
  std::vector<ScatteredBlock> scattered;
  std::vector<uint32_t> got;
  uint64_t batch_bytes = 0;
  auto block_end = [&](uint64_t k) { return std::min(f.bytes, (k + 1) * block); };
  auto check = [&](uint64_t k, uint32_t crc) -> Status {
    if (crc == want[k - lo]) return Status();
    return ChecksumMismatch(f.path, k, block, f.bytes);
  };
  auto defer = [&](uint64_t k, size_t first, size_t end) {
    alone.push_back(k);
    alone_src.push_back(span.data() + (k * block - start));
    for (size_t i = first; i < end; ++i) deferred.push_back({seg_src[i], segs[i].dst, segs[i].bytes});
  };
  auto flush = [&]() -> Status {
    // Fused blocks go three at a time; one or two left over are verified alone.
    while (fused.size() % 3 != 0) {
      defer(fused.back().k, fused.back().first, fused.back().end);
      fused.pop_back();
    }
    scattered.clear();
    for (const Fused& b : fused) scattered.push_back({seg_src[b.first], &segs[b.first], b.end - b.first});
    got.resize(fused.size());
    Crc32cEachAndCopy(scattered.data(), block, fused.size(), got.data());
    for (size_t i = 0; i < fused.size(); ++i) MORPH_RETURN_IF_ERROR(check(fused[i].k, got[i]));
    // Alone: whole blocks three at a time; the file's last block may be short (moved last).
    size_t whole = alone.size();
    for (size_t i = 0; i < alone.size(); ++i) {
      if (block_end(alone[i]) - alone[i] * block == block) continue;
      std::swap(alone[i], alone.back());
      std::swap(alone_src[i], alone_src.back());
      --whole;
      break;
    }
    got.resize(alone.size());
    Crc32cEach(alone_src.data(), block, whole, got.data());
    if (whole < alone.size()) got[whole] = Crc32c(alone_src[whole], f.bytes - alone[whole] * block);
    for (size_t i = 0; i < alone.size(); ++i) MORPH_RETURN_IF_ERROR(check(alone[i], got[i]));
    for (const Copy& c : deferred) std::memcpy(c.dst, c.src, c.bytes);
    bytes_read += static_cast<int64_t>(batch_bytes);
    fused.clear(), alone.clear(), alone_src.clear(), deferred.clear();
    segs.clear(), seg_src.clear();
    batch_bytes = 0;
    return Status();
  };
  // The walk is past the current block: fused if rows need all of it, else verified alone.
  constexpr uint64_t kBatchBytes = uint64_t{64} << 10;
  auto close = [&]() -> Status {
    if (cur.k == UINT64_MAX) return Status();
    const uint64_t bs = cur.k * block, be = block_end(cur.k);
    batch_bytes += be - bs;
    if (cur.gapless && cur.covered_end == be && be - bs == block) {
      fused.push_back({cur.k, cur.first, segs.size()});
    } else {
      defer(cur.k, cur.first, segs.size());
    }
    cur.k = UINT64_MAX;
    if (batch_bytes >= 4 * kBatchBytes || (batch_bytes >= kBatchBytes && fused.size() % 3 == 0)) {
      return flush();
    }
    return Status();
  };
  for (int64_t pos = e0; pos < e1;) {
    const int64_t r = pos / g.row;
    const int64_t row_end = std::min(e1, (r + 1) * g.row);
    const auto [soff, doff] = row_offsets(r);
    const uint64_t x = piece_offset + static_cast<uint64_t>((soff + pos - r * g.row) * es);
    const uint64_t y = x + static_cast<uint64_t>((row_end - pos) * es);
    char* d = out + (doff + pos - r * g.row) * es;
    for (uint64_t k = x / block; k * block < y; ++k) {
      const uint64_t a = std::max(x, k * block), b = std::min(y, block_end(k));
      if (k != cur.k) {
        MORPH_RETURN_IF_ERROR(close());
        cur = {k, k * block, true, segs.size()};
      }
      if (a != cur.covered_end) cur.gapless = false;
      cur.covered_end = b;
      segs.push_back({d + (a - x), static_cast<size_t>(b - a)});
      seg_src.push_back(span.data() + (a - start));
    }
    pos = row_end;
  }
  MORPH_RETURN_IF_ERROR(close());
  return flush();
}

}  // namespace

StatusOr<CheckpointReader> CheckpointReader::Open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return NotFoundError("no checkpoint folder " + dir);
  std::map<int, std::string> done;
  std::map<int, std::vector<std::string>> leftovers;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    int r = -1;
    char tail = 0;
    if (std::sscanf(name.c_str(), "rank-%d%c", &r, &tail) == 1 && r >= 0) {
      done[r] = e.path().string();
    } else if (std::sscanf(name.c_str(), ".rank-%d.tmp%c", &r, &tail) == 2 && tail == '-') {
      leftovers[r].push_back(name);
    }
  }
  if (ec) return ErrnoToStatus(ec.value(), "listing " + dir, __FILE__, __LINE__);
  auto incomplete = [&](int r, int n) {
    std::string msg = "checkpoint " + dir + " is incomplete: rank " + std::to_string(r) +
                      (n > 0 ? " of " + std::to_string(n) : "") + " has not finished saving";
    if (leftovers.count(r)) msg += " (its save was interrupted: leftover " + leftovers[r][0] + ")";
    return FailedPreconditionError(msg);
  };
  if (done.empty()) return incomplete(leftovers.empty() ? 0 : leftovers.begin()->first, 0);

  CheckpointReader reader;
  reader.dir_ = dir;
  std::map<std::string, size_t> tensor_index;
  bool first = true;
  for (const auto& [r, path] : done) {
    const std::string man_path = path + "/manifest.json";
    json m;
    try {
      std::ifstream in(man_path);
      if (!in) return DataLossError("cannot read manifest " + man_path);
      m = json::parse(in);
      const int version =
          m.at("format") == "morph-checkpoint" ? m.at("version").get<int>() : -1;
      if (version != 1 && version != kFormatVersion) {
        return DataLossError("manifest " + man_path + " is not a morph checkpoint of version 1 to " +
                             std::to_string(kFormatVersion));
      }
      const int n = m.at("num_ranks").get<int>();
      const int64_t step = m.at("step").get<int64_t>();
      if (m.at("rank").get<int>() != r) {
        return DataLossError("manifest " + man_path + " says rank " + m.at("rank").dump());
      }
      if (first) {
        reader.num_ranks_ = n;
        reader.step_ = step;
        const json& config = m.at("config");
        reader.config_json_ = config.is_null() ? "" : config.dump();
        first = false;
      } else if (n != reader.num_ranks_ || step != reader.step_) {
        return DataLossError("manifest " + man_path + " is of step " + std::to_string(step) +
                             " with " + std::to_string(n) + " ranks, others of step " +
                             std::to_string(reader.step_) + " with " +
                             std::to_string(reader.num_ranks_));
      }
      const json& jf = m.at("files").at(0);
      File f;
      f.path = path + "/" + jf.at("name").get<std::string>();
      f.bytes = jf.at("bytes").get<uint64_t>();
      f.block_bytes = jf.at("block_bytes").get<uint64_t>();
      if (f.block_bytes == 0 || f.block_bytes % kAlign != 0) {
        return DataLossError("manifest " + man_path + " has inconsistent checksum blocks");
      }
      // (Not (bytes + block - 1) / block: a manifest's size near 2^64 would wrap.)
      f.blocks = f.bytes / f.block_bytes + (f.bytes % f.block_bytes != 0 ? 1 : 0);
      if (version == 1) {
        f.crc = jf.at("crc32c").get<std::vector<uint32_t>>();
        if (f.crc.size() != f.blocks) {
          return DataLossError("manifest " + man_path + " has inconsistent checksum blocks");
        }
      } else {
        f.crc_path = path + "/" + jf.at("checksums").get<std::string>();
        struct stat cst;
        if (::stat(f.crc_path.c_str(), &cst) != 0) {
          return DataLossError("checksum file " + f.crc_path + " is missing: " +
                               std::strerror(errno));
        }
        if (static_cast<uint64_t>(cst.st_size) != 4 * f.blocks) {
          return DataLossError("checksum file " + f.crc_path + " has " +
                               std::to_string(cst.st_size) + " bytes, its data file's " +
                               std::to_string(f.blocks) + " blocks need " +
                               std::to_string(4 * f.blocks) + " (truncated or overwritten)");
        }
      }
      struct stat st;
      if (::stat(f.path.c_str(), &st) != 0) {
        return DataLossError("data file " + f.path + " is missing: " + std::strerror(errno));
      }
      if (static_cast<uint64_t>(st.st_size) != f.bytes) return SizeMismatch(f.path, st, f.bytes);
      const int file_index = static_cast<int>(reader.files_.size());
      reader.files_.push_back(std::move(f));
      for (const json& jt : m.at("tensors")) {
        TensorInfo t;
        t.name = jt.at("name").get<std::string>();
        MORPH_ASSIGN_OR_RETURN(t.dtype, ParseDType(jt.at("dtype").get<std::string>()),
                               "manifest " << man_path);
        t.shape = jt.at("shape").get<std::vector<int64_t>>();
        auto [it, fresh] = tensor_index.emplace(t.name, reader.tensors_.size());
        if (fresh) {
          reader.tensors_.push_back(t);
          reader.pieces_.emplace_back();
        } else if (reader.tensors_[it->second].dtype != t.dtype ||
                   reader.tensors_[it->second].shape != t.shape) {
          return DataLossError("manifest " + man_path +
                               " disagrees with other ranks on dtype or "
                               "shape of tensor '" +
                               t.name + "'");
        }
      }
      for (const json& jp : m.at("pieces")) {
        const std::string name = jp.at("tensor").get<std::string>();
        auto it = tensor_index.find(name);
        if (it == tensor_index.end()) {
          return DataLossError("manifest " + man_path + " has a piece of unlisted tensor '" + name +
                               "'");
        }
        Piece p;
        p.file = file_index;
        MORPH_ASSIGN_OR_RETURN(p.shard, ShardFromJson(jp.at("shard")),
                               "manifest " << man_path << ", a piece of tensor '" << name << "'");
        p.offset = jp.at("offset").get<uint64_t>();
        const TensorInfo& t = reader.tensors_[it->second];
        const std::string bad =
            "manifest " + man_path + " has an inconsistent piece of tensor '" + name + "'";
        const uint64_t file_bytes = reader.files_[static_cast<size_t>(file_index)].bytes;
        if (p.offset % kAlign != 0 ||
            !PieceFits(p.offset, p.shard.NumElements(), DTypeSize(t.dtype), file_bytes)) {
          return DataLossError(bad + ": offset " + std::to_string(p.offset) + " and " +
                               std::to_string(p.shard.NumElements()) + " elements of " +
                               std::to_string(DTypeSize(t.dtype)) + " bytes do not fit in its " +
                               std::to_string(file_bytes) + "-byte data file");
        }
        if (!Box::FromShape(t.shape).Contains(p.shard.frame) ||
            p.shard.frame.rank() != static_cast<int>(t.shape.size())) {
          return DataLossError(bad + ": shard " + p.shard.ToString() + " lies outside its shape");
        }
        reader.pieces_[it->second].push_back(std::move(p));
      }
    } catch (const json::exception& e) {
      return DataLossError("manifest " + man_path + " is unreadable: " + e.what());
    }
  }
  for (int r = 0; r < reader.num_ranks_; ++r) {
    if (!done.count(r)) return incomplete(r, reader.num_ranks_);
  }
  if (done.rbegin()->first >= reader.num_ranks_) {
    return DataLossError("checkpoint " + dir + " has a folder for rank " +
                         std::to_string(done.rbegin()->first) + " but " +
                         std::to_string(reader.num_ranks_) + " ranks");
  }
  // Saved pieces of a tensor must cover it exactly once.
  for (size_t t = 0; t < reader.tensors_.size(); ++t) {
    const TensorInfo& info = reader.tensors_[t];
    int64_t saved = 0;
    StatusOr<int64_t> total_or = Box::FromShape(info.shape).NumElements();
    if (!total_or.ok()) {
      return DataLossError("checkpoint " + dir + ": tensor '" + info.name + "' has shape " +
                           Box::FromShape(info.shape).ToString() + ": " +
                           std::string(total_or.status().message()));
    }
    const int64_t total = *total_or;
    const auto& ps = reader.pieces_[t];
    std::vector<std::vector<Box>> boxes;
    for (const Piece& p : ps) {
      saved += p.shard.NumElements();
      boxes.push_back(ShardBoxes(p.shard));
    }
    for (size_t i = 0; i < boxes.size(); ++i) {
      for (size_t j = i + 1; j < boxes.size(); ++j) {
        for (const Box& a : boxes[i]) {
          for (const Box& b : boxes[j]) {
            if (!Intersect(a, b).empty()) {
              return DataLossError("checkpoint " + dir + ": saved pieces " +
                                   ps[i].shard.ToString() + " and " + ps[j].shard.ToString() +
                                   " of tensor '" + info.name + "' overlap");
            }
          }
        }
      }
    }
    if (saved != total) {
      // Name the first box no piece holds (pieces are disjoint here, so some box is missing).
      std::vector<Box> missing = {Box::FromShape(info.shape)};
      for (const auto& piece_boxes : boxes) {
        for (const Box& b : piece_boxes) {
          std::vector<Box> rest;
          for (const Box& m : missing) {
            for (Box& r : Subtract(m, b)) rest.push_back(std::move(r));
          }
          missing = std::move(rest);
        }
      }
      return DataLossError("checkpoint " + dir + ": saved pieces of tensor '" + info.name +
                           "' hold " + std::to_string(saved) + " of its " + std::to_string(total) +
                           " elements" +
                           (missing.empty() ? std::string()
                                            : "; no piece holds " + missing.front().ToString()));
    }
  }
  return reader;
}

Status CheckpointReader::Verify() const {
  constexpr uint64_t kChunkBytes = uint64_t{16} << 20;
  std::vector<char> fallback;
  std::vector<uint32_t> want, got;
  std::vector<const void*> blocks;
  for (const File& f : files_) {
    MORPH_ASSIGN_SYSCALL_OR_RETURN(int fd, ::open(f.path.c_str(), O_RDONLY), "opening " << f.path);
    Fd data(fd), crcs;
    struct stat st {};
    MORPH_SYSCALL_RETURN_IF_ERROR(::fstat(fd, &st)) << "reading the size of " << f.path;
    if (static_cast<uint64_t>(st.st_size) < f.bytes) return SizeMismatch(f.path, st, f.bytes);
    if (!f.crc_path.empty()) {
      MORPH_ASSIGN_SYSCALL_OR_RETURN(int cfd, ::open(f.crc_path.c_str(), O_RDONLY),
                                     "opening " << f.crc_path);
      crcs = Fd(cfd);
    }
    const BlockSource source{f.path,     f.bytes,    f.block_bytes, f.crc,
                             f.crc_path, data.get(), crcs.get()};
    const uint64_t per = std::max<uint64_t>(1, kChunkBytes / f.block_bytes);
    for (uint64_t lo = 0; lo < f.blocks; lo += per) {
      const uint64_t hi = std::min(f.blocks, lo + per);
      const uint64_t start = lo * f.block_bytes, stop = std::min(f.bytes, hi * f.block_bytes);
      FileSpan span;
      MORPH_RETURN_IF_ERROR(span.Load(data.get(), f.path, start, stop, fallback));
      MORPH_RETURN_IF_ERROR(LoadChecksums(source, lo, hi, want));
      // Whole blocks together; the file's last block may be short.
      const uint64_t whole = (stop - start) / f.block_bytes;
      blocks.resize(static_cast<size_t>(whole));
      got.resize(static_cast<size_t>(hi - lo));
      for (uint64_t i = 0; i < whole; ++i) blocks[i] = span.data() + i * f.block_bytes;
      Crc32cEach(blocks.data(), f.block_bytes, static_cast<size_t>(whole), got.data());
      if (whole < hi - lo) {
        got[whole] =
            Crc32c(span.data() + whole * f.block_bytes, stop - start - whole * f.block_bytes);
      }
      for (uint64_t k = lo; k < hi; ++k) {
        if (got[k - lo] != want[k - lo]) return ChecksumMismatch(f.path, k, f.block_bytes, f.bytes);
      }
      *bytes_read_ += static_cast<int64_t>(stop - start);
    }
  }
  return Status();
}

Status CheckpointReader::Read(const std::string& name, DType dtype, const Shard& shard,
                              BufferView dst) const {
  return ReadImpl(name, dtype, shard, dst, nullptr);
}

Status CheckpointReader::Read(const TensorInfo& tensor, const Shard& shard, BufferView dst) const {
  return ReadImpl(tensor.name, tensor.dtype, shard, dst,
                  tensor.padded_shape.empty() ? nullptr : &tensor.padded_shape);
}

Status CheckpointReader::ReadImpl(const std::string& name, DType dtype, const Shard& shard,
                                  BufferView dst, const std::vector<int64_t>* padded) const {
  auto it = std::find_if(tensors_.begin(), tensors_.end(),
                         [&](const TensorInfo& t) { return t.name == name; });
  if (it == tensors_.end()) {
    return NotFoundError("checkpoint " + dir_ + " has no tensor '" + name + "'");
  }
  const size_t t = static_cast<size_t>(it - tensors_.begin());
  const TensorInfo& info = *it;
  if (dtype != info.dtype) {
    return InvalidArgumentError("tensor '" + name + "' was saved as " +
                                std::string(DTypeName(info.dtype)) + ", not " +
                                std::string(DTypeName(dtype)));
  }
  const Box whole = Box::FromShape(info.shape);
  if (padded != nullptr) {
    const Box bound = Box::FromShape(*padded);
    if (bound.rank() != whole.rank() || !bound.Contains(whole)) {
      return InvalidArgumentError("padded shape " + bound.ToString() + " of tensor '" + name +
                                  "' does not contain its saved shape " + whole.ToString());
    }
    if (shard.frame.rank() != bound.rank() || !bound.Contains(shard.frame)) {
      return InvalidArgumentError("shard " + shard.ToString() + " lies outside tensor '" + name +
                                  "' of padded shape " + bound.ToString());
    }
  } else if (shard.frame.rank() != whole.rank() || !whole.Contains(shard.frame)) {
    return InvalidArgumentError("shard " + shard.ToString() + " lies outside tensor '" + name +
                                "' of shape " + whole.ToString());
  }
  const int es = DTypeSize(dtype);
  const size_t want_bytes = static_cast<size_t>(shard.NumElements()) * static_cast<size_t>(es);
  if (dst.bytes != want_bytes) {
    return InvalidArgumentError("buffer for tensor '" + name + "' has " +
                                std::to_string(dst.bytes) + " bytes, shard " + shard.ToString() +
                                " needs " + std::to_string(want_bytes));
  }
  std::vector<char> staging;
  char* out = static_cast<char*>(dst.data);
  if (dst.kind == MemoryKind::kCuda) {
    staging.resize(want_bytes);
    out = staging.data();
  }
  constexpr int64_t kMaxSpan = int64_t{64} << 20;
  std::vector<char> buf;
  struct OpenFile {
    Fd data, crcs;
  };
  std::map<int, OpenFile> fds;
  // The shard's state boxes (all of it unless it reaches into padding), and its padding, zeroed.
  const std::vector<Box> state_boxes = IntersectShard(shard, whole);
  if (!whole.Contains(shard.frame)) {
    for (const Box& sb : ShardBoxes(shard)) {
      for (const Box& pad : Subtract(sb, whole)) {
        MORPH_ASSIGN_OR_RETURN(StridedView v, ViewOf(shard, pad));
        MORPH_ASSIGN_OR_RETURN(CopyGeometry g, MakeCopyGeometry(v, v));
        for (int64_t e = 0; e < g.num_elements; e += g.row) {
          int64_t off = g.dst_offset, rem = e / g.row;
          for (int d = g.outer_rank - 1; d >= 0; --d) {
            off += (rem % g.outer_shape[d]) * g.dst_stride[d];
            rem /= g.outer_shape[d];
          }
          std::memset(out + off * es, 0, static_cast<size_t>(g.row * es));
        }
      }
    }
  }
  for (const Piece& p : pieces_[t]) {
    const File& f = files_[static_cast<size_t>(p.file)];
    for (const Box& wb : state_boxes) {
      for (const Box& ib : IntersectShard(p.shard, wb)) {
        MORPH_ASSIGN_OR_RETURN(StridedView src, ViewOf(p.shard, ib));
        MORPH_ASSIGN_OR_RETURN(StridedView dv, ViewOf(shard, ib));
        MORPH_ASSIGN_OR_RETURN(CopyGeometry g, MakeCopyGeometry(dv, src));
        const int64_t n = g.num_elements;
        const int64_t span = (ElementOffset(src, n - 1) - ElementOffset(src, 0) + 1) * es;
        int64_t per = n;
        if (span > kMaxSpan) {
          per = std::max<int64_t>(1, n / ((span + kMaxSpan - 1) / kMaxSpan));
          per = std::max(g.row, per / g.row * g.row);
        }
        auto open = fds.find(p.file);
        if (open == fds.end()) {
          OpenFile of;
          MORPH_ASSIGN_SYSCALL_OR_RETURN(int fd, ::open(f.path.c_str(), O_RDONLY),
                                         "opening " << f.path);
          of.data = Fd(fd);
          struct stat st {};
          MORPH_SYSCALL_RETURN_IF_ERROR(::fstat(fd, &st)) << "reading the size of " << f.path;
          if (static_cast<uint64_t>(st.st_size) < f.bytes) return SizeMismatch(f.path, st, f.bytes);
          if (!f.crc_path.empty()) {
            MORPH_ASSIGN_SYSCALL_OR_RETURN(int cfd, ::open(f.crc_path.c_str(), O_RDONLY),
                                           "opening " << f.crc_path);
            of.crcs = Fd(cfd);
          }
          open = fds.emplace(p.file, std::move(of)).first;
        }
        const BlockSource source{f.path, f.bytes, f.block_bytes, f.crc, f.crc_path,
                                 open->second.data.get(), open->second.crcs.get()};
        for (int64_t e0 = 0; e0 < n; e0 += per) {
          MORPH_RETURN_IF_ERROR(CopyVerified(source, p.offset, g, es, e0, std::min(n, e0 + per),
                                             out, buf, *bytes_read_));
        }
      }
    }
  }
  if (dst.kind == MemoryKind::kCuda) {
#if MORPH_WITH_CUDA
    MORPH_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(dst.data, staging.data(), want_bytes, cudaMemcpyHostToDevice))
        << "loading tensor '" << name << "'";
#else
    return FailedPreconditionError("CUDA buffer given but morph was built without CUDA");
#endif
  }
  return Status();
}

}  // namespace morph
