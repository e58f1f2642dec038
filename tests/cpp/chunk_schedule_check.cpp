// Drives csrc/cpu/chunk_schedule.h with threads of its own, for tests/test_chunk_schedule.py:
//   chunk_schedule_check once CHUNKS THREADS     every chunk runs once; each thread begins at
//                                                the front of its own share
//   chunk_schedule_check stall CHUNKS THREADS [SECONDS]
//                                                the first chunk to run waits until every other
//                                                chunk has run: the other threads must take the
//                                                rest of its thread's share
// Prints "ok" and exits 0, or says what went wrong and exits 1 (the stall case gives up
// after SECONDS, default 300: the sign of a schedule that waits for the slowest thread).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu/chunk_schedule.h"

using fastopt::steal_chunks;

namespace {
template <typename Worker>
void on_std_threads(int team, const Worker& worker) {
  std::vector<std::thread> threads;
  for (int i = 0; i < team; ++i) threads.emplace_back([&worker, i] { worker(i); });
  for (auto& t : threads) t.join();
}

thread_local int my_index = -1;
}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: chunk_schedule_check once|stall CHUNKS THREADS [SECONDS]\n");
    return 2;
  }
  const bool stall = std::strcmp(argv[1], "stall") == 0;
  const int64_t chunks = std::atoll(argv[2]);
  const int threads = std::atoi(argv[3]);
  const int seconds = argc == 5 ? std::atoi(argv[4]) : 300;
  std::vector<std::atomic<int>> runs(chunks);
  std::vector<int> by(chunks, -1);
  std::atomic<int64_t> done{0};
  int64_t gave_up_at = -1;  // chunks done when the held chunk gave up waiting
  std::atomic<bool> holding{false};
  int holder = -1;
  int64_t held = -1;
  auto team = [&](int n, const auto& worker) {
    on_std_threads(n, [&](int i) {
      my_index = i;
      worker(i);
    });
  };
  steal_chunks(chunks, threads, team, [&](int64_t c) {
    by[c] = my_index;
    if (stall && !holding.exchange(true)) {  // the first chunk to run: held until the rest has run
      holder = my_index;
      held = c;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
      while (done.load() < chunks - 1) {
        if (std::chrono::steady_clock::now() > deadline) {
          gave_up_at = done.load();
          break;
        }
        std::this_thread::yield();
      }
    }
    runs[c].fetch_add(1);
    done.fetch_add(1);
  });
  if (gave_up_at >= 0) {
    std::printf("stalled: %lld of the other %lld chunks ran while one thread was held\n",
                static_cast<long long>(gave_up_at), static_cast<long long>(chunks - 1));
    return 1;
  }
  for (int64_t c = 0; c < chunks; ++c) {
    if (runs[c].load() != 1) {
      std::printf("chunk %lld ran %d times\n", static_cast<long long>(c), runs[c].load());
      return 1;
    }
  }
  // of the chunks of its own share a thread ran, the first is its share's front (where it began)
  for (int i = 0; i < threads; ++i) {
    const int64_t lo = chunks * i / threads, hi = chunks * (i + 1) / threads;
    const int64_t first = std::find(by.begin() + lo, by.begin() + hi, i) - by.begin();
    if (first != hi && first != lo) {
      std::printf("thread %d began its share at chunk %lld, not its front %lld\n", i, static_cast<long long>(first),
                  static_cast<long long>(lo));
      return 1;
    }
  }
  if (stall) {  // the holder ran its held chunk only
    for (int64_t c = 0; c < chunks; ++c) {
      if (by[c] == holder && c != held) {
        std::printf("the held thread %d ran chunk %lld too\n", holder, static_cast<long long>(c));
        return 1;
      }
    }
  }
  std::printf("ok\n");
  return 0;
}
