// Which thread runs which chunk of a CPU kernel's work.
//
// The work is cut into chunks beforehand (how, does not depend on the thread count).
// Each thread starts on a contiguous share of them, front to back (memory it streams
// through in order, the same share every call), and once its share is done takes chunks
// one by one from the back of the others'.  A thread the system runs less (another
// process, or the training's own threads on the same cores) thus takes fewer chunks
// instead of holding up the rest: with the work split evenly beforehand, the whole update
// waited for the slowest thread (half the rate with one busy process beside two threads).
//
// Depends on nothing but the standard library, so that a test can drive it with threads
// of its own (tests/cpp/chunk_schedule_check.cpp); tensor_walk.h runs it on ATen's.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace fastopt {

// chunk(c) for every c in [0, chunks), each exactly once, on the `threads` workers that
// run_team(threads, worker) starts: worker(i) for each i in [0, threads), each once, on
// threads running at once (a team with fewer threads may give one thread several i).
template <typename RunTeam, typename Chunk>
void steal_chunks(int64_t chunks, int threads, const RunTeam& run_team, const Chunk& chunk) {
  // share i: chunks [front, back), packed into one word (front high, back low): taking
  // from either end is one compare-exchange
  struct alignas(64) Share { std::atomic<uint64_t> range; };
  std::vector<Share> shares(threads);
  for (int i = 0; i < threads; ++i) {
    const uint64_t lo = chunks * i / threads, hi = chunks * (i + 1) / threads;
    shares[i].range.store((lo << 32) | hi, std::memory_order_relaxed);
  }
  auto take = [&](int i, bool from_front) -> int64_t {  // a chunk of share i, or -1 once it is empty
    uint64_t r = shares[i].range.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = r >> 32, hi = r & 0xffffffffu;
      if (lo >= hi) return -1;
      const uint64_t next = from_front ? (((lo + 1) << 32) | hi) : ((lo << 32) | (hi - 1));
      if (shares[i].range.compare_exchange_weak(r, next, std::memory_order_relaxed))
        return static_cast<int64_t>(from_front ? lo : hi - 1);
    }
  };
  run_team(threads, [&](int me) {
    for (int64_t c; (c = take(me, true)) >= 0;) chunk(c);
    for (int k = 1; k < threads; ++k) {
      const int other = (me + k) % threads;
      for (int64_t c; (c = take(other, false)) >= 0;) chunk(c);
    }
  });
}

}  // namespace fastopt
