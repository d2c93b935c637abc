#pragma once
// A Chrome-trace timeline of one rank (opens in Perfetto and chrome://tracing): complete events
// ("ph": "X") with microsecond times from the start of the run.

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "json_output.hpp"

namespace train_gpt {

class timeline {
 public:
  using clock = std::chrono::steady_clock;

  explicit timeline(bool enabled) : enabled_(enabled), start_(clock::now()) {}
  bool enabled() const noexcept { return enabled_; }

  /// An event on track `track` ("compute", "tp/cp exchange", "pipeline wait", "dp reduction", ...).
  void add(std::string name, const char* track, clock::time_point begin, clock::time_point end) {
    if (!enabled_) return;
    events_.push_back({std::move(name), track, us(begin), us(end) - us(begin)});
  }

  /// Writes the events of rank `rank` to `path` (one JSON document).
  void write(const std::string& path, int rank) const {
    std::ofstream out = weft_programs::open_json_output(path);
    out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
    out << "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " << rank << ", \"args\": {\"name\": \"rank " << rank
        << "\"}}";
    std::vector<std::string> tracks;
    for (const event& e : events_) {
      int tid = 0;
      while (tid < static_cast<int>(tracks.size()) && tracks[static_cast<std::size_t>(tid)] != e.track) ++tid;
      if (tid == static_cast<int>(tracks.size())) {
        tracks.push_back(e.track);
        out << ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " << rank << ", \"tid\": " << tid
            << ", \"args\": {\"name\": " << weft_programs::json_string(e.track) << "}}";
      }
      out << ",\n{\"ph\": \"X\", \"pid\": " << rank << ", \"tid\": " << tid
          << ", \"name\": " << weft_programs::json_string(e.name) << ", \"ts\": " << e.ts << ", \"dur\": " << e.dur
          << "}";
    }
    out << "\n]}\n";
  }

 private:
  struct event {
    std::string name;
    std::string track;
    double ts, dur;
  };
  double us(clock::time_point t) const { return std::chrono::duration<double, std::micro>(t - start_).count(); }

  bool enabled_;
  clock::time_point start_;
  std::vector<event> events_;
};

}  // namespace train_gpt
