#pragma once
/// \file
/// Distributed checkpoints: every rank writes the pieces it owns (tp slices, pp stages, ZeRO and
/// FSDP shards, optimizer moments) to its own safetensors file in one directory, in parallel and
/// in the background; rank 0 then writes index.json, which says where every piece of every
/// tensor lies. A reader in any other layout reads, from whichever files hold them, only the
/// pieces that overlap what it needs. docs/checkpoint.md describes the format for other tools.
///
/// A save: the ranks exchange what they hold (names and regions, no values), plan who writes
/// each distinct piece (a replica once, writers balanced), copy their own pieces (the snapshot:
/// the only time the training thread spends) and hand them to a background thread, which
/// writes `rank-NNNNN.safetensors` durably and then `rank-NNNNN.json` (the rank's checksums,
/// the sign that its file is complete). Rank 0's thread waits for every rank's manifest of this
/// save, then writes index.json with a rename: a directory without index.json is not a
/// checkpoint, so a save killed at any moment leaves the previous one as the latest.

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <weft/checkpoint/async_writer.hpp>
#include <weft/checkpoint/detail/crc32.hpp>
#include <weft/checkpoint/detail/distributed_plan.hpp>
#include <weft/checkpoint/detail/file_io.hpp>
#include <weft/checkpoint/safetensors.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>

namespace weft::checkpoint {

/// An all-gather of one string per rank: called on every rank with this rank's string, returns
/// every rank's, in rank order. `exchange_over(communicator)` (checkpoint/exchange.hpp) makes one
/// from a communicator; tests simulate ranks with threads.
using exchange_function = std::function<std::vector<std::string>(std::string)>;

/// One piece this rank holds: region `part` of the global tensor `name` (of `shape`), its values
/// row-major within the region. The bytes stay the caller's: save() copies them.
struct local_piece {
  std::string name;
  dtype type = dtype::float32;
  std::vector<std::int64_t> shape;
  region part;
  std::span<const std::byte> bytes;
};

/// A piece over `values`; throws weft::error when their number is not the region's size.
template <element T>
local_piece piece_of(std::string name, std::vector<std::int64_t> shape, region part, std::span<const T> values) {
  const std::int64_t count = element_count(part);
  if (static_cast<std::uint64_t>(count) != values.size()) {
    fail("piece " + region_text(part) + " of tensor '" + name + "' holds " + std::to_string(count) + " elements but " +
         std::to_string(values.size()) + " values were given; pass the values of exactly that region");
  }
  return {std::move(name), dtype_of<T>, std::move(shape), std::move(part), std::as_bytes(values)};
}

/// What a checkpoint records besides the tensors.
struct checkpoint_info {
  std::int64_t step = 0;
  std::map<std::string, std::int64_t> data_position;  ///< where the data loader resumes (its own keys)
  std::map<std::string, std::int64_t> layout;         ///< the layout saved from (world_size, dp, tp, pp, ...)
  std::string model;                                  ///< names the model, so a reader can refuse another model's directory
};

struct save_options {
  /// How many complete checkpoints to keep in the root directory (the newest); 0 keeps all.
  std::size_t keep = 0;
  /// How long the background writes may take, and how long rank 0 waits for the other ranks'
  /// files before it reports them missing (async_writer's deadline; 0: no deadline).
  std::chrono::milliseconds deadline = default_write_deadline;
};

inline constexpr std::string_view index_file_name = "index.json";

/// The file that marks rank `rank`'s part of a save as durable: rank-00003.json.
inline std::string rank_manifest_name(int rank) {
  std::string name = rank_file_name(rank);
  return name.substr(0, name.size() - std::string_view(".safetensors").size()) + ".json";
}

namespace detail {

/// Writes `text` to `path` atomically (temporary file, fsync, rename, directory fsync).
inline std::uint64_t write_text_atomically(const std::filesystem::path& path, std::string_view text) {
  replace_file_atomically(path, [&](int fd) { return write_all(fd, std::as_bytes(std::span(text))); });
  return text.size();
}

/// The whole of a small file (an index or a manifest), or nothing when it does not exist.
inline std::optional<std::string> read_small_file(const std::filesystem::path& path) {
  file_descriptor in(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in.is_open()) {
    const int code = errno;
    if (code == ENOENT) return std::nullopt;
    fail("cannot open '" + path.string() + "': " + errno_text(code) + "; " + std::string(errno_advice(code)));
  }
  struct stat status {};
  if (::fstat(in.get(), &status) != 0 || !S_ISREG(status.st_mode)) fail("'" + path.string() + "' is not a regular file");
  std::string text(static_cast<std::size_t>(status.st_size), '\0');
  if (read_exact(in.get(), std::as_writable_bytes(std::span(text)), 0) != 0) fail("reading '" + path.string() + "' failed");
  return text;
}

/// A step directory's name is its step in decimal, nothing else.
inline std::optional<std::int64_t> step_of_directory_name(const std::string& name) {
  if (name.empty() || name.size() > 18 || !std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::stoll(name);
}

/// The step directories under `root`, by step, and whether each is complete (has an index).
inline std::vector<std::pair<std::int64_t, bool>> step_directories(const std::filesystem::path& root) {
  std::vector<std::pair<std::int64_t, bool>> steps;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(root, error)) {
    const auto step = step_of_directory_name(entry.path().filename().string());
    if (!step || !entry.is_directory(error)) continue;
    steps.emplace_back(*step, std::filesystem::exists(entry.path() / index_file_name, error));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

inline void append_piece_declaration(std::string& out, const piece_declaration& p) {
  out += '[';
  append_json_string(out, p.name);
  out += ",\"" + std::string(safetensors_name(p.type)) + "\",";
  append_integers(out, p.shape);
  out += ',';
  append_integers(out, p.part.offset);
  out += ',';
  append_integers(out, p.part.extent);
  out += ']';
}

/// What a rank tells the others at the start of a save.
struct save_announcement {
  bool busy = false;
  std::string error;
  std::string nonce;
  std::vector<piece_declaration> pieces;
};

inline std::string announcement_text(const save_announcement& a) {
  std::string out = "{\"busy\":";
  out += a.busy ? "true" : "false";
  out += ",\"error\":";
  append_json_string(out, a.error);
  out += ",\"nonce\":";
  append_json_string(out, a.nonce);
  out += ",\"pieces\":[";
  for (std::size_t i = 0; i < a.pieces.size(); ++i) {
    if (i != 0) out += ',';
    append_piece_declaration(out, a.pieces[i]);
  }
  return out + "]}";
}

inline save_announcement parse_announcement(std::string_view text, int rank) {
  index_parser p("announcement of rank " + std::to_string(rank));
  const json_value root = json_parser::parse(text);
  save_announcement a;
  for (const json_member& m : root.members) {
    if (m.key == "busy") a.busy = m.value.boolean;
  }
  a.error = p.member(root, "error", json_value::kind::string).text;
  a.nonce = p.member(root, "nonce", json_value::kind::string).text;
  for (const json_value& item : p.member(root, "pieces", json_value::kind::array).items) {
    piece_declaration d;
    d.name = item.items.at(0).text;
    d.type = dtype_from_safetensors_name(item.items.at(1).text).value();
    for (const json_value& v : item.items.at(2).items) d.shape.push_back(*v.integer);
    for (const json_value& v : item.items.at(3).items) d.part.offset.push_back(*v.integer);
    for (const json_value& v : item.items.at(4).items) d.part.extent.push_back(*v.integer);
    a.pieces.push_back(std::move(d));
  }
  return a;
}

/// Removes a step directory: its index first (durably), so a crash midway leaves an incomplete
/// directory, never a checkpoint with files missing.
inline void remove_step_directory(const std::filesystem::path& directory) {
  std::error_code error;
  if (std::filesystem::remove(directory / index_file_name, error)) sync_directory_of(directory / index_file_name);
  std::filesystem::remove_all(directory, error);
  if (error) {
    std::fprintf(stderr, "weft: could not remove old checkpoint '%s': %s; remove it by hand\n", directory.c_str(),
                 error.message().c_str());
  }
}

}  // namespace detail

/// The newest complete checkpoint under `root` (the step directory with the highest step that
/// has an index.json), or nothing.
inline std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root) {
  const auto steps = detail::step_directories(root);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (it->second) return root / std::to_string(it->first);
  }
  return std::nullopt;
}

/// Collective over the ranks of `exchange`: each rank that writes (`writes`) makes `folder` and a
/// file in it now, and removes the file. Throws the same weft::error on every rank, naming each rank
/// that cannot and why, so a folder nobody can write is found before training rather than at the
/// first save, steps later.
inline void check_writable(int rank, int world_size, const exchange_function& exchange, const std::filesystem::path& folder,
                           bool writes = true) {
  std::string error;
  if (writes) {
    std::error_code made;
    std::filesystem::create_directories(folder, made);
    const std::filesystem::path probe = folder / (".weft-write-check-" + std::to_string(rank));
    if (made) {
      error = "cannot make the folder (" + made.message() + ")";
    } else if (const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644); fd < 0) {
      const int code = errno;
      error = "cannot create a file in it (" + std::string(std::strerror(code)) + ")";
    } else {
      const bool written = ::write(fd, "w", 1) == 1;
      const int code = errno;
      ::close(fd);
      std::filesystem::remove(probe, made);
      if (!written) error = "cannot write a file in it (" + std::string(std::strerror(code)) + ")";
    }
  }
  const std::vector<std::string> texts = exchange(error);
  if (static_cast<int>(texts.size()) != world_size) {
    fail("check_writable: the exchange returned " + std::to_string(texts.size()) + " strings for " +
         std::to_string(world_size) + " ranks");
  }
  // One clause per distinct reason, naming its ranks (the first 8 of them), so a folder no rank of
  // a large job can write gives one short line.
  std::map<std::string, std::vector<int>> ranks_of;
  for (int r = 0; r < world_size; ++r) {
    if (!texts[static_cast<std::size_t>(r)].empty()) ranks_of[texts[static_cast<std::size_t>(r)]].push_back(r);
  }
  std::string message;
  for (const auto& [reason, ranks] : ranks_of) {
    std::string who = ranks.size() == 1 ? "rank" : "ranks";
    for (std::size_t i = 0; i < ranks.size() && i < 8; ++i) who += (i == 0 ? " " : ", ") + std::to_string(ranks[i]);
    if (ranks.size() > 8) who += " and " + std::to_string(ranks.size() - 8) + " more";
    message += (message.empty() ? "" : "; ") + who + " " + reason;
  }
  if (!message.empty()) {
    fail("'" + folder.string() + "' is not a folder checkpoints can be written to (" + message +
         "): give one every writing rank can create and write");
  }
}

/// Saves distributed checkpoints to `root/<step>/`, one background thread per rank.
///
///     weft::checkpoint::distributed_saver saver(rank, size, weft::checkpoint::exchange_over(world), "ckpt", {.keep = 3});
///     saver.save({.step = step, .data_position = {{"sample", next}}, .layout = {{"tp", tp}}, .model = "gpt2-124M"}, pieces);
///     ... train on; the next save() after this one is written ...
///     saver.wait();   // before exit: this rank's files (and on rank 0 the index) are durable
class distributed_saver {
 public:
  distributed_saver(int rank, int world_size, exchange_function exchange, std::filesystem::path root, save_options options = {})
      : rank_(rank), world_(world_size), exchange_(std::move(exchange)), root_(std::move(root)), options_(options),
        writer_(options.deadline) {
    if (world_size < 1 || rank < 0 || rank >= world_size) {
      fail("distributed_saver: rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " ranks is not a rank of the group");
    }
  }

  /// Collective over the ranks of the exchange. Plans the save of `pieces` (this rank's) with the
  /// other ranks, copies the pieces this rank writes and returns; the files are written in the
  /// background. Returns false, on every rank, without saving, when some rank is still writing
  /// the previous checkpoint (at most one checkpoint's snapshot is held per rank); call wait()
  /// first to never skip. Throws weft::error, on every rank, when any rank's pieces are
  /// inconsistent or the previous write of any rank failed (naming the rank).
  bool save(const checkpoint_info& info, std::span<const local_piece> pieces) {
    const std::filesystem::path directory = root_ / std::to_string(info.step);
    detail::save_announcement mine;
    mine.busy = writer_.busy();
    try {
      if (info.step < 0) fail("the step of a checkpoint is a non-negative number, not " + std::to_string(info.step));
      if (!mine.busy) writer_.wait();  // reports a failed previous write here, on every rank
      for (const local_piece& piece : pieces) {
        if (piece.bytes.size() != static_cast<std::uint64_t>(element_count(piece.part)) * size_of(piece.type)) {
          fail("piece " + region_text(piece.part) + " of tensor '" + piece.name + "' has " + std::to_string(piece.bytes.size()) +
               " bytes, not the region's size; build pieces with piece_of");
        }
        mine.pieces.push_back({piece.name, piece.type, piece.shape, piece.part});
      }
      if (!mine.busy) {
        if (rank_ == 0) {
          // An index of an earlier save of this step must not outlive the files it describes.
          std::error_code error;
          if (std::filesystem::remove(directory / index_file_name, error)) detail::sync_directory_of(directory / index_file_name);
          std::random_device random;
          mine.nonce = std::to_string(random()) + "-" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
        }
        std::filesystem::create_directories(directory);
      }
    } catch (const std::exception& e) {
      mine.error = e.what();
    }

    const std::vector<std::string> texts = exchange_(detail::announcement_text(mine));
    if (static_cast<int>(texts.size()) != world_) {
      fail("distributed_saver: the exchange returned " + std::to_string(texts.size()) + " announcements for " + std::to_string(world_) + " ranks");
    }
    std::vector<detail::save_announcement> all;
    std::vector<std::vector<piece_declaration>> declared;
    bool any_busy = false;
    for (int r = 0; r < world_; ++r) {
      all.push_back(detail::parse_announcement(texts[r], r));
      any_busy = any_busy || all.back().busy;
      declared.push_back(all.back().pieces);
    }
    for (int r = 0; r < world_; ++r) {
      if (!all[r].error.empty()) fail("the checkpoint of step " + std::to_string(info.step) + " was not saved: rank " + std::to_string(r) + ": " + all[r].error);
    }
    if (any_busy) return false;
    const write_plan plan = plan_writers(declared);

    // The snapshot: only the pieces this rank writes.
    auto snapshot = std::make_shared<checkpoint_file>();
    snapshot->metadata = {{"format", std::string(index_format_name)}, {"step", std::to_string(info.step)}, {"rank", std::to_string(rank_)}};
    for (std::size_t i : plan.written_by[rank_]) {
      const local_piece& piece = pieces[i];
      tensor_record record{.name = piece_key(piece.name, piece.part), .type = piece.type, .shape = piece.part.extent, .bytes = {}};
      record.bytes.assign(piece.bytes.begin(), piece.bytes.end());
      snapshot->tensors.push_back(std::move(record));
    }

    std::vector<write_request> steps(rank_ == 0 ? 2 : 1);
    const std::string nonce = all[0].nonce;
    const int rank = rank_;
    steps[0].path = directory / rank_file_name(rank);
    steps[0].write = [snapshot, directory, nonce, rank, step = info.step] {
      return write_rank_files(*snapshot, directory, nonce, rank, step);
    };
    if (rank_ == 0) {
      steps[1].path = directory / index_file_name;
      steps[1].write = [directory, nonce, info, declared, plan, options = options_] {
        return commit(directory, nonce, info, declared, plan, options);
      };
    }
    writer_.submit(std::move(steps));
    return true;
  }

  /// Waits until this rank's files are durable (on rank 0: also the index, so the checkpoint is
  /// complete) and throws the background write's error, if any.
  void wait() { writer_.wait(); }

  /// Whether this rank is still writing a checkpoint.
  bool busy() const noexcept { return writer_.busy(); }

  /// The time and bytes of this rank's last completed write (rank 0's includes waiting for the
  /// other ranks and the index).
  double last_write_seconds() const noexcept { return writer_.last_write_seconds(); }
  std::uint64_t last_write_bytes() const noexcept { return writer_.last_write_bytes(); }

  const std::filesystem::path& root() const noexcept { return root_; }

 private:
  /// On the writing thread: the rank's safetensors file, durable, then its manifest.
  static std::uint64_t write_rank_files(const checkpoint_file& snapshot, const std::filesystem::path& directory,
                                        const std::string& nonce, int rank, std::int64_t step) {
    std::string manifest = "{\"nonce\":";
    detail::append_json_string(manifest, nonce);
    manifest += ",\"rank\":" + std::to_string(rank) + ",\"step\":" + std::to_string(step) + ",\"pieces\":{";
    for (std::size_t i = 0; i < snapshot.tensors.size(); ++i) {
      if (i != 0) manifest += ',';
      detail::append_json_string(manifest, snapshot.tensors[i].name);
      manifest += ':' + std::to_string(detail::crc32(snapshot.tensors[i].bytes));
    }
    const std::uint64_t bytes = detail::write_safetensors_file(directory / rank_file_name(rank), snapshot);
    manifest += "},\"bytes\":" + std::to_string(bytes) + "}";
    return bytes + detail::write_text_atomically(directory / rank_manifest_name(rank), manifest);
  }

  struct manifest {
    std::uint64_t bytes = 0;
    std::map<std::string, std::uint32_t, std::less<>> crc32;
  };

  /// Rank `rank`'s manifest of the save `nonce`, or nothing while it is not there.
  static std::optional<manifest> read_manifest(const std::filesystem::path& directory, int rank, const std::string& nonce) {
    using detail::json_member;
    using detail::json_parser;
    using detail::json_value;
    const auto text = detail::read_small_file(directory / rank_manifest_name(rank));
    if (!text) return std::nullopt;
    const json_value root = json_parser::parse(*text);
    detail::index_parser p((directory / rank_manifest_name(rank)).string());
    if (p.member(root, "nonce", json_value::kind::string).text != nonce) return std::nullopt;  // an earlier save's
    manifest m;
    m.bytes = static_cast<std::uint64_t>(p.integer(p.member(root, "bytes", json_value::kind::number), "bytes", 0));
    for (const json_member& piece : p.member(root, "pieces", json_value::kind::object).members) {
      m.crc32[piece.key] = static_cast<std::uint32_t>(p.integer(piece.value, "crc32", 0));
    }
    return m;
  }

  /// On rank 0's writing thread: waits for every rank's manifest, writes the index, keeps the newest.
  static std::uint64_t commit(const std::filesystem::path& directory, const std::string& nonce, const checkpoint_info& info,
                              const std::vector<std::vector<piece_declaration>>& declared, const write_plan& plan,
                              const save_options& options) {
    const int ranks = static_cast<int>(declared.size());
    std::vector<std::optional<manifest>> manifests(static_cast<std::size_t>(ranks));
    const auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::milliseconds(1);
    for (int waiting = ranks; waiting > 0;) {
      waiting = 0;
      for (int r = 0; r < ranks; ++r) {
        if (!manifests[r]) manifests[r] = read_manifest(directory, r, nonce);
        if (!manifests[r]) ++waiting;
      }
      if (waiting == 0) break;
      const auto waited = std::chrono::steady_clock::now() - start;
      if (options.deadline.count() > 0 && waited > options.deadline * 9 / 10) {
        std::string missing;
        for (int r = 0; r < ranks && missing.size() < 200; ++r) missing += manifests[r] ? "" : (missing.empty() ? "" : ", ") + std::to_string(r);
        fail("the checkpoint '" + directory.string() + "' is incomplete: after " +
             std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(waited).count()) + " ms, rank(s) " + missing +
             " have not finished writing their files (no " + rank_manifest_name(0).substr(0, 5) +
             "N.json of this save); those ranks report why. The previous checkpoint stays the latest");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(20));
    }

    checkpoint_index index;
    index.model = info.model;
    index.step = info.step;
    index.data_position = info.data_position;
    index.layout = info.layout;
    index.layout.try_emplace("world_size", ranks);
    std::map<std::string, std::size_t, std::less<>> position;
    for (const piece_declaration& t : plan.tensors) {
      position[t.name] = index.tensors.size();
      index.tensors.push_back({t.name, t.type, t.shape, {}});
    }
    for (int r = 0; r < ranks; ++r) {
      index.files.push_back({r, rank_file_name(r), manifests[r]->bytes});
      for (std::size_t i : plan.written_by[r]) {
        const piece_declaration& d = declared[r][i];
        const std::string key = piece_key(d.name, d.part);
        const auto crc = manifests[r]->crc32.find(key);
        if (crc == manifests[r]->crc32.end()) {
          fail("rank " + std::to_string(r) + "'s manifest in '" + directory.string() + "' lacks piece '" + key + "' that it was to write");
        }
        index.tensors[position.at(d.name)].pieces.push_back({rank_file_name(r), key, d.part, crc->second});
      }
    }
    for (saved_tensor& t : index.tensors) {
      std::sort(t.pieces.begin(), t.pieces.end(), [](const saved_piece& a, const saved_piece& b) { return a.part < b.part; });
    }
    const std::uint64_t bytes = detail::write_text_atomically(directory / index_file_name, index_json(index));

    // The newest `keep` complete checkpoints stay; incomplete directories of earlier steps are
    // leftovers of interrupted saves.
    const std::filesystem::path root = directory.parent_path();
    const auto steps = detail::step_directories(root);
    std::size_t complete_newer = 0;
    for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
      const auto [step, complete] = *it;
      if (step >= info.step) {
        if (complete) ++complete_newer;
        continue;
      }
      if (!complete) {
        detail::remove_step_directory(root / std::to_string(step));
      } else if (options.keep > 0 && ++complete_newer > options.keep) {
        detail::remove_step_directory(root / std::to_string(step));
      }
    }
    return bytes;
  }

  int rank_;
  int world_;
  exchange_function exchange_;
  std::filesystem::path root_;
  save_options options_;
  async_writer writer_;  // last: its thread stops before the members above go
};

struct read_options {
  /// The most bytes a piece is read in at a time (its checksum is computed on the way).
  std::size_t chunk_bytes = std::size_t{4} << 20;
  /// Whether read() reads each piece it takes values from whole, to check its checksum. Without,
  /// it reads only the overlap, one contiguous run at a time (for a reader that ran verify()
  /// first, as weft-ckpt export does).
  bool check_checksums = true;
};

/// A complete distributed checkpoint, open for reading: its index, and the files read on demand.
/// Reading needs no other rank: each rank reads, from whichever files hold them, the pieces that
/// overlap the regions it asks for, each whole in chunks of at most read_options::chunk_bytes
/// to check its checksum, and copies only the overlap into the caller's memory.
class distributed_checkpoint {
 public:
  /// `path`: a step directory (with index.json), or a root of step directories (then its newest
  /// complete one). Throws weft::error when there is none, or the index is refused.
  explicit distributed_checkpoint(const std::filesystem::path& path, read_options options = {}) : options_(options) {
    std::error_code error;
    if (!std::filesystem::exists(path, error)) fail("checkpoint '" + path.string() + "' does not exist; check the path");
    if (!std::filesystem::is_directory(path, error)) {
      fail("checkpoint '" + path.string() + "' is not a directory; a distributed checkpoint is a directory with an index.json");
    }
    if (std::filesystem::exists(path / index_file_name, error)) {
      directory_ = path;
    } else if (auto latest = latest_checkpoint(path)) {
      directory_ = *latest;
    } else {
      fail("'" + path.string() + "' holds no complete checkpoint: it has no " + std::string(index_file_name) +
           ", and no step directory in it has one (a save that was interrupted leaves none); pick another directory");
    }
    const auto text = detail::read_small_file(directory_ / index_file_name);
    if (!text) fail("'" + (directory_ / index_file_name).string() + "' vanished while opening it; was the checkpoint removed (keep)?");
    index_ = parse_index(*text, (directory_ / index_file_name).string());
  }

  const checkpoint_index& index() const noexcept { return index_; }
  const std::filesystem::path& directory() const noexcept { return directory_; }

  /// The tensor `name`; throws weft::error listing similar names.
  const saved_tensor& tensor(std::string_view name) const {
    if (const saved_tensor* t = index_.find(name)) return *t;
    std::vector<std::string_view> similar;
    for (const saved_tensor& t : index_.tensors) {
      if (!name.empty() && (t.name.ends_with(name) || name.ends_with(t.name))) similar.push_back(t.name);
    }
    std::string message = "checkpoint '" + directory_.string() + "' has no tensor named '" + std::string(name) + "' (it has " +
                          std::to_string(index_.tensors.size()) + ")";
    if (!similar.empty()) message += "; similar names: " + detail::names_text(similar, 5);
    fail(message + "; is it a checkpoint of this model (saved as '" + index_.model + "')?");
  }

  /// Reads region `part` of tensor `name` into `out` (row-major within the region).
  void read(std::string_view name, const region& part, std::span<std::byte> out) {
    const saved_tensor& t = tensor(name);
    const std::uint64_t needed = static_cast<std::uint64_t>(element_count(part)) * size_of(t.type);
    if (out.size() != needed) {
      fail("reading region " + region_text(part) + " of tensor '" + t.name + "' needs " + std::to_string(needed) + " bytes of " +
           std::string(safetensors_name(t.type)) + ", but the destination has " + std::to_string(out.size()));
    }
    for (const read_step& step : plan_read(t, part)) {
      if (options_.check_checksums) {
        stream_piece(t, *step.piece, &part, out.data());
      } else {
        copy_overlap(t, *step.piece, step.overlap, part, out.data());
      }
    }
  }

  /// Region `part` of tensor `name` as T; throws weft::error when the tensor's dtype is not T's.
  template <element T>
  std::vector<T> read(std::string_view name, const region& part) {
    const saved_tensor& t = tensor(name);
    if (t.type != dtype_of<T>) {
      fail("tensor '" + t.name + "' is " + std::string(safetensors_name(t.type)) + " in checkpoint '" + directory_.string() +
           "', not " + std::string(safetensors_name(dtype_of<T>)) + "; read it as " + std::string(detail::cpp_type_name(t.type)));
    }
    std::vector<T> values(static_cast<std::size_t>(element_count(part)));
    read(name, part, std::as_writable_bytes(std::span(values)));
    return values;
  }

  /// The whole tensor `name` as T (for small tensors and tests: a reader of a large model asks
  /// for its own region).
  template <element T>
  std::vector<T> read(std::string_view name) {
    return read<T>(name, whole_region(tensor(name).shape));
  }

  /// Checks the whole checkpoint: every file listed is there with its size and a valid header,
  /// every piece is in its file with its dtype and shape and matches its checksum, and each
  /// tensor's pieces tile it (no overlap, no gap). Returns one message per problem, each naming
  /// the file and the tensor; empty when all is well. Memory: one chunk.
  std::vector<std::string> verify() {
    std::vector<std::string> problems;
    for (const saved_file& f : index_.files) {
      std::error_code error;
      const std::filesystem::path path = directory_ / f.file;
      const auto size = std::filesystem::file_size(path, error);
      if (error) {
        problems.push_back("file '" + f.file + "' of rank " + std::to_string(f.rank) + " is missing or unreadable: " + error.message());
      } else if (size != f.bytes) {
        problems.push_back("file '" + f.file + "' of rank " + std::to_string(f.rank) + " has " + std::to_string(size) +
                           " bytes; the index says " + std::to_string(f.bytes) + " (truncated or replaced)");
      }
    }
    for (const saved_tensor& t : index_.tensors) {
      std::int64_t covered = 0;
      for (std::size_t i = 0; i < t.pieces.size(); ++i) {
        covered += element_count(t.pieces[i].part);
        for (std::size_t j = i + 1; j < t.pieces.size(); ++j) {
          if (element_count(t.pieces[i].part) > 0 && intersection(t.pieces[i].part, t.pieces[j].part)) {
            problems.push_back("tensor '" + t.name + "': pieces '" + t.pieces[i].key + "' (file '" + t.pieces[i].file + "') and '" +
                               t.pieces[j].key + "' (file '" + t.pieces[j].file + "') overlap");
          }
        }
        try {
          stream_piece(t, t.pieces[i], nullptr, nullptr);
        } catch (const std::exception& e) {
          problems.push_back(e.what());
        }
      }
      const std::int64_t total = element_count(std::span<const std::int64_t>(t.shape));
      if (covered != total) {
        problems.push_back("tensor '" + t.name + "' " + detail::shape_text(t.shape) + ": its pieces hold " + std::to_string(covered) +
                           " of its " + std::to_string(total) + " elements");
      }
    }
    return problems;
  }

 private:
  struct open_file {
    detail::file_descriptor fd;
    std::map<std::string, safetensors_entry, std::less<>> entries;
  };

  open_file& file(const saved_tensor& t, const saved_piece& piece) {
    auto it = files_.find(piece.file);
    if (it != files_.end()) return it->second;
    const std::filesystem::path path = directory_ / piece.file;
    open_file opened;
    opened.fd = detail::file_descriptor(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!opened.fd.is_open()) {
      const int code = errno;
      std::string rank = "?";
      for (const saved_file& f : index_.files) {
        if (f.file == piece.file) rank = std::to_string(f.rank);
      }
      fail("checkpoint '" + directory_.string() + "': file '" + piece.file + "' of rank " + rank + ", which holds piece '" + piece.key +
           "' of tensor '" + t.name + "', cannot be opened: " + detail::errno_text(code) +
           "; the checkpoint is incomplete: restore the file or pick another checkpoint");
    }
    for (safetensors_entry& entry : read_safetensors_layout(path).tensors) {
      std::string key = entry.name;
      opened.entries.emplace(std::move(key), std::move(entry));
    }
    return files_.emplace(piece.file, std::move(opened)).first->second;
  }

  /// Reads `piece` whole, in chunks, checking its checksum; copies the part inside `wanted` to
  /// `out` (row-major in `wanted`) when `out` is given. Throws naming the file, tensor and piece.
  void stream_piece(const saved_tensor& t, const saved_piece& piece, const region* wanted, std::byte* out) {
    open_file& f = file(t, piece);
    const std::string where = "checkpoint '" + directory_.string() + "', file '" + piece.file + "', tensor '" + t.name + "', piece '" + piece.key + "'";
    const auto entry = f.entries.find(piece.key);
    if (entry == f.entries.end()) fail(where + ": the file has no such piece; the file does not belong to this index: pick another checkpoint");
    if (entry->second.type != t.type || entry->second.shape != piece.part.extent) {
      fail(where + ": the file holds it as " + std::string(safetensors_name(entry->second.type)) + " " + detail::shape_text(entry->second.shape) +
           ", the index as " + std::string(safetensors_name(t.type)) + " " + detail::shape_text(piece.part.extent) +
           "; the file does not belong to this index: pick another checkpoint");
    }
    const std::size_t element = size_of(t.type);
    const std::int64_t count = element_count(piece.part);
    const std::int64_t chunk_elements = static_cast<std::int64_t>(std::max<std::size_t>(1, options_.chunk_bytes / element));
    std::vector<std::byte> chunk(static_cast<std::size_t>(std::min(count, chunk_elements)) * element);
    std::uint32_t crc = 0;
    const std::size_t dims = piece.part.extent.size();
    const std::int64_t row_length = dims == 0 ? 1 : piece.part.extent.back();
    std::vector<std::int64_t> stride(dims, 1);  // of `wanted`
    for (std::size_t d = dims; d-- > 1;) stride[d - 1] = stride[d] * wanted_extent(wanted, d);
    for (std::int64_t begin = 0; begin < count; begin += chunk_elements) {
      const std::int64_t end = std::min(count, begin + chunk_elements);
      const std::span<std::byte> bytes(chunk.data(), static_cast<std::size_t>(end - begin) * element);
      const int code = detail::read_exact(f.fd.get(), bytes, entry->second.begin + static_cast<std::uint64_t>(begin) * element);
      if (code != 0) fail(where + ": reading it failed: " + (code == -1 ? std::string("the file ended") : detail::errno_text(code)));
      crc = detail::crc32_update(crc, bytes);
      if (out == nullptr) continue;
      for (std::int64_t p = begin; p < end;) {
        const std::int64_t row = p / row_length;
        const std::int64_t column = p % row_length;
        const std::int64_t stop = std::min(end, (row + 1) * row_length);
        if (dims == 0) {
          std::memcpy(out, chunk.data(), element);
          p = stop;
          continue;
        }
        std::int64_t target = 0;
        bool inside = true;
        std::int64_t rest = row;
        for (std::size_t d = dims - 1; d-- > 0;) {
          const std::int64_t global = piece.part.offset[d] + rest % piece.part.extent[d];
          rest /= piece.part.extent[d];
          if (global < wanted->offset[d] || global >= wanted->offset[d] + wanted->extent[d]) {
            inside = false;
            break;
          }
          target += (global - wanted->offset[d]) * stride[d];
        }
        if (inside) {
          const std::int64_t first = piece.part.offset[dims - 1] + column;
          const std::int64_t low = std::max(first, wanted->offset[dims - 1]);
          const std::int64_t high = std::min(first + (stop - p), wanted->offset[dims - 1] + wanted->extent[dims - 1]);
          if (low < high) {
            std::memcpy(out + static_cast<std::size_t>(target + low - wanted->offset[dims - 1]) * element,
                        chunk.data() + static_cast<std::size_t>(p - begin + low - first) * element,
                        static_cast<std::size_t>(high - low) * element);
          }
        }
        p = stop;
      }
    }
    if (crc != piece.crc32) {
      char numbers[80];
      std::snprintf(numbers, sizeof numbers, "0x%08x, the index says 0x%08x", crc, piece.crc32);
      fail(where + ": checksum mismatch: the data's CRC-32 is " + numbers +
           "; the file is corrupt: restore it or pick another checkpoint");
    }
  }

  /// Copies `overlap` (inside both the piece and `wanted`) from the file to `out`, one run of the
  /// last dimension at a time, without a checksum.
  void copy_overlap(const saved_tensor& t, const saved_piece& piece, const region& overlap, const region& wanted, std::byte* out) {
    open_file& f = file(t, piece);
    const std::string where = "checkpoint '" + directory_.string() + "', file '" + piece.file + "', tensor '" + t.name + "', piece '" + piece.key + "'";
    const auto entry = f.entries.find(piece.key);
    if (entry == f.entries.end() || entry->second.type != t.type || entry->second.shape != piece.part.extent) {
      fail(where + ": the file lacks the piece or holds it with another dtype or shape; the file does not belong to this index: pick another checkpoint");
    }
    const std::size_t element = size_of(t.type);
    const std::size_t dims = overlap.extent.size();
    const std::int64_t run = dims == 0 ? 1 : overlap.extent.back();
    const std::int64_t runs = element_count(overlap) / std::max<std::int64_t>(run, 1);
    for (std::int64_t r = 0; r < runs && run > 0; ++r) {
      std::int64_t rest = r, source = 0, target = 0, source_stride = 1, target_stride = 1;
      if (dims > 0) {
        source = overlap.offset[dims - 1] - piece.part.offset[dims - 1];
        target = overlap.offset[dims - 1] - wanted.offset[dims - 1];
        source_stride = piece.part.extent[dims - 1];
        target_stride = wanted.extent[dims - 1];
        for (std::size_t d = dims - 1; d-- > 0;) {
          const std::int64_t index = overlap.offset[d] + rest % overlap.extent[d];
          rest /= overlap.extent[d];
          source += (index - piece.part.offset[d]) * source_stride;
          target += (index - wanted.offset[d]) * target_stride;
          source_stride *= piece.part.extent[d];
          target_stride *= wanted.extent[d];
        }
      }
      const std::span<std::byte> bytes(out + static_cast<std::size_t>(target) * element, static_cast<std::size_t>(run) * element);
      const int code = detail::read_exact(f.fd.get(), bytes, entry->second.begin + static_cast<std::uint64_t>(source) * element);
      if (code != 0) fail(where + ": reading it failed: " + (code == -1 ? std::string("the file ended") : detail::errno_text(code)));
    }
  }

  static std::int64_t wanted_extent(const region* wanted, std::size_t d) { return wanted == nullptr ? 1 : wanted->extent[d]; }

  read_options options_;
  std::filesystem::path directory_;
  checkpoint_index index_;
  std::map<std::string, open_file, std::less<>> files_;
};

}  // namespace weft::checkpoint
